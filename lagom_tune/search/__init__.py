"""Search: evaluate settings through a cost model and choose the ones that finish an iteration first."""

# `lagom-tune search` keeps NCCL's (or the backend's) defaults unless a plan is predicted faster by
# more than this fraction: smaller gains are within the model's held-out error.
DEFAULT_MIN_GAIN = 0.02
