"""The SpeculativeServing API: pydantic models (the single source) and the CRD generated from them."""
