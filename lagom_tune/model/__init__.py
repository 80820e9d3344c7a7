"""Cost models: how long GEMMs and collectives take, alone and beside each other
(``model.contention`` holds ``CostModel`` and ``load_model``)."""
