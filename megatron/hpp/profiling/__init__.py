"""Measured profiles (``tools/profile_ops.py``): ``ops`` (every op timed and sized on this
device), ``overheads`` (what the runtime costs beyond the ops), ``collectives``
(measured collective tables), ``file`` (the profile file: provenance, merging, summary),
``timing`` (the clock and fake groups they share).  May import models, data and
distributed; never training."""
