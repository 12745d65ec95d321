"""Metrics: MMD, symmetry removal, predictive metrics, tables."""
