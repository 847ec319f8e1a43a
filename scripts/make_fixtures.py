#!/usr/bin/env python
"""Make the committed test fixtures with the REAL megatron-core 0.16.1 and PEFT 0.7.1 on CPU (gloo).

    PYTHONPATH=.fixture-deps python scripts/make_fixtures.py --family dense     # tests/fixtures
    PYTHONPATH=.fixture-deps python scripts/make_fixtures.py --family moe       # tests/fixtures_moe
    PYTHONPATH=.fixture-deps python scripts/make_fixtures.py --family deepseek  # tests/fixtures_deepseek

``--only NAME ...`` remakes some of a family's fixtures (the others keep their bytes), ``--out DIR`` writes
elsewhere, ``--no-hf-check`` skips the check against transformers' own classes. The outline lives in
scripts/fixturegen/library.py; dense.py, moe.py and deepseek.py beside it hold what each family changes.

PEFT 0.7.1 must be installed apart (PEFT >= 0.8's Megatron path is broken or different):
    pip install --no-deps --target .fixture-deps peft==0.7.1
"""

from fixturegen.library import main

if __name__ == "__main__":
    main()
