"""Helpers shared by the tests (importable as ``support``: pyproject puts tests/ on pytest's path)."""
