"""The task stores: one module per backend, each behind the contract in ``tasks/base.py``."""
