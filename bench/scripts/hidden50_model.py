"""hidden at 50 GB/s, L = 16K for gpu-perf's step (issue 29 §8) under two more models than
``seqpar.testing.streams`` plays: a link sleep of a high-priority stream waits for the next thread block
of the compute grid in flight to retire (at most ``cta`` seconds; ``tail`` = the whole kernel, the
equal-priority case), and every sleep runs ``1 + slow`` times its calibrated length (a sleep clock slower
under load than when calibrated). Same recording and roofline as ``python -m seqpar.testing.streams``
(attention at 560 TFLOP/s). Needs torch's CUDA build (fake CUDA tensors):

    PYTHONPATH=. $(.ci/cuda_venv)/bin/python bench/scripts/hidden50_model.py

What it said at 763b07d (BENCHMARKS.md, "The ring on one GPU"): with sleeps that start within 1 ms of being
allowed, hidden stays at the schedule's 0.929 (15% slow sleeps: 0.918); only a sleep held for the whole
kernel (the tail) drops it to 0.56-0.58. So a slow sleep clock cannot explain the H200's 0.76 / 0.79;
SM dispatch can, and high-priority link streams remove it unless the attention kernel is persistent."""
from seqpar.comm.schedule import hidden, hidden_bound, replay
from seqpar.testing.streams import MAIN, Timing, host_schedule, ring_step_log


def simulate(log, timing, cta, slow):
    """``seqpar.testing.streams.simulate``'s loop with a sleep's SM wait capped at ``cta`` seconds and every
    sleep ``1 + slow`` times as long; returns T_step."""
    queues = {s: log.on(s) for s in log.streams}
    pos = dict.fromkeys(queues, 0)
    free = dict.fromkeys(queues, 0.0)
    done, kernels = {}, []  # record index -> time; (start, end) of each compute-stream kernel piece
    while True:
        best = None
        for s, q in queues.items():
            if pos[s] < len(q):
                op = q[pos[s]]
                if op.kind == "wait" and op.version >= 0:
                    t = None if op.version not in done else max(free[s], done[op.version])
                else:
                    t = free[s]
                if t is not None and (best is None or (t, s != MAIN) < (best[0], best[1] != MAIN)):
                    best = (t, s)
        if best is None:
            return max(free.values())
        t, s = best
        op = queues[s][pos[s]]
        pos[s] += 1
        if op.kind in ("kernel", "sleep"):
            begin = t
            if op.kind == "sleep" and s != MAIN:
                inflight = [e for b, e in kernels if b <= t < e]
                if inflight:
                    begin = min(inflight[-1], t + cta)
            now = begin
            for piece in timing.pieces(op):
                piece *= (1 + slow) if op.kind == "sleep" else 1
                if s == MAIN:
                    kernels.append((now, now + piece))
                now += piece
            free[s] = now
        else:
            free[s] = t
            if op.kind == "record":
                done[op.index] = t


def main():
    timing = Timing(attention_flops=560e12)

    def per_cycle(c):
        return c / timing.cycles_per_second

    for causal in (True, False):
        log = ring_step_log(seq_local=16384, layout="hf", causal=causal, bandwidth=50e9, high_priority=True)
        events = host_schedule(log, timing)
        bound = hidden_bound(events, per_cycle)
        t_c, t_t = bound["t_compute"], replay(events, per_cycle, compute=False)
        sleeps = sum(1 for op in log.ops if op.kind == "sleep")
        print(f"causal={causal}: T_compute {t_c * 1e3:.1f} ms, T_transfer {t_t * 1e3:.2f} ms, {sleeps} sleeps, "
              f"bound {bound['hidden']:.3f}")
        for slow in (0.0, 0.05, 0.10, 0.15):
            row = [f"{hidden(t_c, t_t, simulate(log, timing, cta, slow)):.3f}"
                   for cta in (0.0, 0.1e-3, 0.25e-3, 0.5e-3, 1e-3, float("inf"))]
            print(f"  sleeps {slow:+.0%} long: hidden at SM wait <= 0 / 0.1 / 0.25 / 0.5 / 1 ms / the whole kernel:",
                  " ".join(row))


if __name__ == "__main__":
    main()
