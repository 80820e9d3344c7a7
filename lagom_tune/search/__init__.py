"""Search: evaluate settings through a cost model and choose the ones that finish an iteration first."""
