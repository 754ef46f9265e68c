import sys

from seqpar.bench.attention import BenchShape
from seqpar.bench.memory import measure_peak
from seqpar.bench.runner import RankPool


def main():
    shape = BenchShape(batch=1, q_heads=8, kv_heads=int(sys.argv[2]), head_dim=32, head_chunks=sys.argv[3] if sys.argv[3]=="auto" else int(sys.argv[3]))
    world = int(sys.argv[1])
    with RankPool(world, device="cpu") as pool:
        for method in ("seqpar_ulysses", "hybrid", "ring"):
            if method == "hybrid" and world < 4:
                continue
            for causal in (True, False):
                peaks = pool.run(measure_peak, method, 2048, causal, shape, 0)
                print(method, world, causal, max(peaks), flush=True)

if __name__ == "__main__":
    main()
