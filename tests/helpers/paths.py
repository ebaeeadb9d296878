"""The checkout's root folder (what holds ``lightning_megatron/``, ``examples/``, ``docs/``, ``README.md``), for tests
that read or run those files: the same folder wherever under ``tests/`` the test file lives."""

import os

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # tests/helpers/paths.py
