"""Plans: the chosen settings at their scopes, with predictions and provenance (``plan.schema``)."""
