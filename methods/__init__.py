"""Posterior approximations, one module per method, one common interface."""
