"""Packages are found, not listed (issue 28 §4: a hand-written list missed ``seqpar.mixers``, so the wheel
had no mixers). ``find:`` in setup.cfg cannot name ``seqpar.integrations``, which comes from
``integrations/`` through setup.cfg's ``package_dir`` mapping, so it is added here by name; the metadata
and the mapping stay in setup.cfg."""

from setuptools import find_packages, setup

integrations = ["seqpar.integrations"] + [f"seqpar.integrations.{p}" for p in find_packages("integrations")]
setup(packages=find_packages(include=["seqpar", "seqpar.*"]) + integrations)
