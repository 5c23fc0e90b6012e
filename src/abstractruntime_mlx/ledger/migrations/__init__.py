"""Alembic migrations of the ledger schema, shipped inside the package (run them with
``abstractruntime-mlx ledger upgrade URL`` or ``Ledger(url, upgrade=True)``; see ``ledger/schema.py``)."""
