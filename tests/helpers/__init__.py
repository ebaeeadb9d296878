"""What several test files share: tiny models, Trainer runs and comparisons (``strategy_utils``), tensor-parallel
setup and gathering (``tp_utils``), the pipeline executor's model (``pp_utils``), MoE weights as one process
holds them (``moe_utils``), checkpoint round trips (``checkpoint_utils``) and the repository's root (``paths``).

``tests/`` is on ``sys.path`` (pyproject.toml's ``[tool.pytest.ini_options] pythonpath``), so every test file,
wherever it lives under ``tests/``, and every rank ``run_on_ranks`` starts imports them as ``helpers.<module>``."""
