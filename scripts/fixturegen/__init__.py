"""Fixture makers: library.py holds the outline every committed test fixture follows; dense.py, moe.py and
deepseek.py hold what each family changes. Run them through scripts/make_fixtures.py --family NAME."""
