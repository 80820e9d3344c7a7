"""Search: evaluate settings through a cost model and choose the ones that finish an iteration first."""

# `lagom-tune search` keeps NCCL's (or the backend's) defaults unless a plan is predicted faster by
# more than this fraction: smaller gains are within the model's held-out error.
DEFAULT_MIN_GAIN = 0.02

# A process- or communicator-wide knob reaches every collective of its scope, the ones the workload
# does not model too: it is pinned only where leaving it to the backend is predicted to cost more
# than this share of the iteration (an audit, 2026-12-04: a plan exported NCCL_NTHREADS=64, which
# the model predicted to change nothing, and Simple collectives ran 1.8x slower at 64 threads).
TIE_TOLERANCE = 1e-3
