"""Test support shared by every suite (importable because pytest puts tests/ on sys.path)."""
