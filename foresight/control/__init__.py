"""How rounds are planned: cost estimators and the verify-length controller."""
