"""Write ``docs/strategy_arguments.md``: every argument of ``MegatronStrategy`` with its type, default,
meaning and constraints.

    python docs/gen_strategy_arguments.py            # rewrite the page
    python docs/gen_strategy_arguments.py --check    # exit 1 if the page is out of date (tests/meta/test_docs.py)

Names, types and defaults come from the signature of ``MegatronStrategy.__init__``; meanings from the
``Args:`` section of its docstring; the group of each argument from the fields of the frozen configs in
the config modules (``parallel/config.py``, ``distributed/config.py``, ``cuda_graphs/config.py``) it lands in. Two tables here fill what the code does not say:
``CONSTRAINTS`` (what the checks in ``config.py``, the topology and the step engine refuse, written by
hand from them) and ``MISSING_DOCSTRINGS`` (meanings of arguments the docstring does not describe yet;
an entry there is dropped once the docstring describes the argument). An argument in neither the
docstring nor ``MISSING_DOCSTRINGS``, or without a ``CONSTRAINTS`` entry, stops the generator: a new
argument cannot reach the page undocumented.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import inspect
import os
import re
import sys
from typing import Dict, List, Optional, Tuple

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGE = os.path.join(ROOT, "docs", "strategy_arguments.md")
COMMAND = "python docs/gen_strategy_arguments.py"

# Meanings of the arguments the strategy's docstring does not describe (yet). Used only while the
# docstring has no entry of the argument's own (one entry ``a / b: text`` shared by several arguments
# does not count: its text is used only when this table has no line for the argument).
MISSING_DOCSTRINGS: Dict[str, str] = {
    "tensor_model_parallel_size":
        "ranks that split each layer's weight matrices and attention heads (Megatron tensor parallelism); "
        "keep them on one node.",
    "pipeline_model_parallel_size":
        "pipeline stages: each holds a contiguous share of the layers, and micro-batches flow through them.",
    "context_parallel_size":
        "ranks that split each sequence (two load-balanced chunks per rank; attention all-gathers keys and values "
        "over them).",
    "expert_model_parallel_size":
        "ranks that split the experts of mixture-of-experts layers.",
    "expert_tensor_parallel_size":
        "tensor-parallel size inside each expert; ``None`` takes ``tensor_model_parallel_size``.",
    "microbatch_group_size_per_vp_stage":
        "interleaved schedule only: micro-batches that pass through one model chunk before the next chunk "
        "starts (Megatron-Core's argument of the same name); ``None`` means ``pipeline_model_parallel_size``.",
    "pipeline_schedule":
        "``\"1f1b\"``: 1F1B (interleaved with virtual stages). ``\"zb-h1\"``: zero-bubble 1F1B (ZB-H1, Qi et al. "
        "2023): a backward computes input gradients only and the column/row-parallel linears' weight gradients run "
        "later, in the bubbles 1F1B leaves; the same activation memory as 1F1B's first stage, about a third of its "
        "bubble with equal forward, input- and weight-gradient times.",
    "process_group_backend":
        "``torch.distributed`` backend; ``None`` picks Lightning's default for the device (``nccl`` on CUDA, "
        "``gloo`` on CPU).",
    "start_method":
        "how Lightning starts the other local processes when it launches them itself: ``popen`` runs the same "
        "command again once per extra device (Lightning's ``_SubprocessScriptLauncher``); ``spawn``, ``fork``, "
        "``forkserver`` start them with ``multiprocessing`` (Lightning's ``_MultiProcessingLauncher``). Not used "
        "under torchrun or SLURM ``srun``, which start every process themselves.",
    "cuda_graph":
        "``None``: eager. ``\"partial\"``: per-layer CUDA graphs captured after ``cuda_graph_warmup_steps`` eager "
        "steps and replayed in the pipeline schedule's order. ``\"full\"``: one graph of the whole "
        "forward-backward of a training step (all micro-batches and stages); batches need fixed shapes and "
        "``training_step`` runs at the capture only. Validation runs eager.",
    "cuda_graph_scope":
        "what ``cuda_graph=\"partial\"`` captures: ``\"layer\"`` (whole transformer layers), ``\"block\"`` (a "
        "chunk's layers in one graph: one replay a micro-batch instead of one a layer, for host-bound models) or a "
        "list of parts among ``\"attn\"``, ``\"mlp\"``, ``\"moe_router\"``, ``\"moe_preprocess\"``.",
    "cuda_graph_warmup_steps":
        "eager training steps before the CUDA graphs are captured.",
    "cuda_graph_backend":
        "``\"cuda\"`` captures real CUDA graphs; ``\"eager\"`` runs the capture bookkeeping without graphs "
        "(for CPU tests).",
    "accelerator": "set by Lightning from ``Trainer(accelerator=...)``; leave it out.",
    "parallel_devices": "set by Lightning from ``Trainer(devices=...)``; leave it out.",
    "cluster_environment": "detected by Lightning (torchrun, SLURM, LSF, MPI, else its own); leave it out "
                           "unless you pass a custom ``ClusterEnvironment`` plugin.",
    "checkpoint_io": "set by Lightning from ``Trainer(plugins=...)``; the strategy writes its own sharded "
                     "checkpoint folders.",
    "precision_plugin": "set by Lightning from ``Trainer(precision=...)``; leave it out.",
}

_POSITIVE = "int >= 1"
_WORLD = "``tp·cp·pp`` must divide the world size (``devices × num_nodes``) and so must ``etp·ep·pp``"

# What the code refuses, per argument (hand-written from config.py, parallel/topology.py, pipeline/,
# distributed/microbatches.py, cuda_graphs/ and strategy.py). "-" when nothing is checked.
CONSTRAINTS: Dict[str, str] = {
    "tensor_model_parallel_size": f"{_POSITIVE}; {_WORLD}; the model's heads, hidden and FFN sizes must split "
                                  "over it (``TransformerConfig`` checks)",
    "pipeline_model_parallel_size": f"{_POSITIVE}; {_WORLD}; the model's ``pipeline_layout`` splits the layers "
                                    "(balanced by counted cost by default; ``\"even\"`` needs ``num_layers`` "
                                    "divisible by ``pp·vpp``; a list gives every virtual stage's count)",
    "virtual_pipeline_model_parallel_size": "``None`` or int >= 1; > 1 needs ``pipeline_model_parallel_size >= 2`` "
                                            "and ``micro_batch_size``, and at least ``pp`` micro-batches per step",
    "context_parallel_size": f"{_POSITIVE}; {_WORLD}; sequence length divisible by ``2·cp``",
    "expert_model_parallel_size": f"{_POSITIVE}; ``etp·ep·pp`` must divide the world size; ``num_experts`` "
                                  "divisible by it",
    "expert_tensor_parallel_size": "``None`` (= ``tensor_model_parallel_size``) or int >= 1; ``etp·ep·pp`` must "
                                   "divide the world size",
    "order": "the axes ``tp``, ``cp``, ``ep``, ``dp``, ``pp`` joined by ``-``, each once; the dense and expert "
             "grids must get the same pipeline groups (keep ``pp`` last)",
    "sequence_parallel": "bool; with ``tensor_model_parallel_size=1`` it warns and is turned off",
    "tp_comm_overlap": "bool; needs ``sequence_parallel=True`` (so tensor_model_parallel_size >= 2); refused with "
                       "``pipeline_schedule=\"zb-h1\"`` and with fp8",
    "micro_batch_size": "``None`` or int >= 1; must divide the per-rank batch size",
    "microbatch_group_size_per_vp_stage": "``None`` or int >= 1; with interleaving it must lie in "
                                          "``[pp, micro-batches per step]``, and the last group must hold 0 or "
                                          ">= ``pp`` micro-batches",
    "pipeline_schedule": "``\"1f1b\"`` or ``\"zb-h1\"``; ``\"zb-h1\"`` refuses virtual stages "
                         "(``virtual_pipeline_model_parallel_size`` > 1), ``cuda_graph`` and ``fp8`` (step engine)",
    "process_group_backend": "a backend ``torch.distributed`` knows",
    "timeout": "a ``timedelta``; used for ``init_process_group`` and every parallel group",
    "start_method": "one of ``popen``, ``spawn``, ``fork``, ``forkserver``",
    "cuda_graph": "``None``, ``\"partial\"`` or ``\"full\"``; needs CUDA (``accelerator=\"gpu\"``); ``\"full\"`` "
                  "refuses ``use_distributed_optimizer``, ``overlap_grad_reduce`` and ``grad_reduce_in_fp32``",
    "cuda_graph_scope": "``\"layer\"`` or ``\"block\"`` alone, or a non-empty list of ``\"attn\"``, ``\"mlp\"``, "
                        "``\"moe_router\"``, ``\"moe_preprocess\"``",
    "cuda_graph_warmup_steps": "int >= 1 when ``cuda_graph`` is set",
    "cuda_graph_backend": "``\"cuda\"`` or ``\"eager\"``",
    "overlap_grad_reduce": "bool; ``cuda_graph=\"full\"`` refuses it",
    "bucket_size": "``None`` or int >= 1 (elements)",
    "grad_reduce_in_fp32": "bool; ``cuda_graph=\"full\"`` refuses it",
    "use_distributed_optimizer": "bool; the optimizer must be elementwise (SGD, Adam, AdamW, ...); "
                                 "``cuda_graph=\"full\"`` refuses it",
    "overlap_param_gather": "bool; needs ``use_distributed_optimizer=True``",
    "fp8": "``None``, ``\"tensorwise\"``, ``\"rowwise\"`` or a ``Float8Config``; at setup: torchao >= 0.18 and a "
           "CUDA GPU of compute capability >= 8.9 (not checked with ``Float8Config(emulate=True)``)",
    "calculate_per_token_loss": "bool; ``training_step`` must then return ``num_tokens`` with the summed loss; "
                                "refuses ``accumulate_grad_batches > 1``",
    "compile_layers": "``True``, ``False``, ``\"auto\"`` or a dict of ``torch.compile`` keywords (``backend``, "
                      "``mode``, ``options``, ``dynamic``, ``fullgraph``); ``\"auto\"`` compiles on CUDA at cp = 1 "
                      "the layers whose calls carry tokens x hidden^2 >= 2^30 (decided at their first call), not under "
                      "``cuda_graph=\"full\"``",
    "accelerator": "-",
    "parallel_devices": "-",
    "cluster_environment": "-",
    "checkpoint_io": "-",
    "precision_plugin": "the precision must be one of ``32-true``, ``bf16-mixed``, ``bf16-true``, ``16-mixed``",
}

LIGHTNING_SET = ("accelerator", "parallel_devices", "cluster_environment", "checkpoint_io", "precision_plugin")
PROCESSES = ("process_group_backend", "timeout", "start_method")
NUMERICS = ("fp8", "calculate_per_token_loss", "compile_layers")


def docstring_args(doc: str) -> Dict[str, Tuple[str, bool]]:
    """``{argument: (meaning, shared)}`` from a Google-style ``Args:`` section; ``a / b: text`` gives both
    the text, marked shared."""
    lines = inspect.cleandoc(doc).splitlines()
    try:
        start = next(i for i, line in enumerate(lines) if line.strip() == "Args:") + 1
    except StopIteration:
        return {}
    entries: List[Tuple[str, List[str]]] = []
    head = ""   # names of an entry whose list of names continues on the next line ("a / b /")
    for line in lines[start:]:
        if line.strip() and not line.startswith(" "):
            break   # the end of the section
        text = line.strip()
        if not text:
            continue
        indent = len(line) - len(line.lstrip())
        if head:
            text, head = head + " " + text, ""
        elif indent > 4 and entries:
            entries[-1][1].append(text)
            continue
        if text.endswith("/") and ":" not in text:
            head = text
            continue
        names, _, meaning = text.partition(":")
        entries.append((names, [meaning.strip()]))
    out: Dict[str, Tuple[str, bool]] = {}
    for names, parts in entries:
        split = re.split(r"\s*/\s*", names.strip())
        for name in split:
            out[name] = (" ".join(p for p in parts if p), len(split) > 1)
    return out


def meaning_of(name: str, documented: Dict[str, Tuple[str, bool]]) -> str:
    """The docstring's own entry; else the table's line; else an entry the argument shares with others."""
    text, shared = documented.get(name, ("", False))
    if text and not shared:
        return text
    return MISSING_DOCSTRINGS.get(name) or text


def _type(annotation: object) -> str:
    if annotation is inspect.Parameter.empty:
        return "-"
    text = annotation if isinstance(annotation, str) else getattr(annotation, "__name__", repr(annotation))
    return f"``{text}``"


def _default(value: object) -> str:
    if value is inspect.Parameter.empty:
        return "required"
    if isinstance(value, datetime.timedelta):
        return f"``timedelta(seconds={int(value.total_seconds())})``"
    return f"``{value!r}``"


def _cell(text: str) -> str:
    text = text.replace("``", "`").replace("|", "\\|").replace("\n", " ")
    # the project's shorthand for its reference texts, linked to where docs/references.md names them
    return re.sub(r"\bseeds? (\d{3})", lambda m: f"[{m.group(0)}](references.md#seed-{m.group(1)})", text)


def groups(strategy: type) -> List[Tuple[str, str, List[str]]]:
    """(title, intro, argument names) in signature order."""
    from lightning_megatron.cuda_graphs.config import CudaGraphConfig
    from lightning_megatron.distributed.config import GradientConfig
    from lightning_megatron.parallel.config import ParallelConfig

    names = [n for n in inspect.signature(strategy.__init__).parameters if n != "self"]
    fields = {config: [f.name for f in dataclasses.fields(config)]
              for config in (ParallelConfig, GradientConfig, CudaGraphConfig)}
    placed = {n for config_fields in fields.values() for n in config_fields} | set(LIGHTNING_SET + PROCESSES + NUMERICS)
    return [
        ("Layout", "How the model and the batch are split; validated as `lightning_megatron.parallel.ParallelConfig` "
         "in the strategy's `__init__`, on every rank, before any process group exists.",
         [n for n in names if n in fields[ParallelConfig]]),
        ("Gradients and the optimizer", "Where gradients live and how they are reduced "
         "(`lightning_megatron.distributed.GradientConfig`). Any of these switches gradients into contiguous "
         "buffers (`param.main_grad`; the optimizer still reads `.grad`); with none of them, gradients stay in "
         "`.grad` and are reduced by one coalesced all-reduce after the pipeline schedule.",
         [n for n in names if n in fields[GradientConfig]]),
        ("CUDA graphs", "Which CUDA graphs the step engine captures (`lightning_megatron.cuda_graphs.CudaGraphConfig`); "
         "GPUs only.", [n for n in names if n in fields[CudaGraphConfig]]),
        ("Numerics", "How the loss is normalised, and float8 matrix multiplications on top of the Trainer's "
         "`precision` (`32-true`, `bf16-mixed`, `bf16-true` or `16-mixed`).", [n for n in names if n in NUMERICS]),
        ("Processes", "How the processes start and talk (see [launching.md](launching.md)).",
         [n for n in names if n in PROCESSES]),
        ("Other", "Arguments not sorted into the groups above yet (`NUMERICS`, `PROCESSES` in the generator).",
         [n for n in names if n not in placed]),
        ("Set by Lightning", "Lightning's `Trainer` fills these from its own arguments; a user leaves them out.",
         [n for n in names if n in LIGHTNING_SET]),
    ]


def render(strategy: Optional[type] = None) -> str:
    """The page's text for ``strategy`` (``MegatronStrategy``; tests pass a subclass)."""
    if strategy is None:
        from lightning_megatron import MegatronStrategy as strategy

    documented = docstring_args(strategy.__doc__ or "")
    parameters = inspect.signature(strategy.__init__).parameters
    problems = []
    out = [
        "# `MegatronStrategy` arguments",
        "",
        f"<!-- Generated by `{COMMAND}` from the strategy's signature and docstring and "
        "the config modules (`parallel/config.py`, `distributed/config.py`, `cuda_graphs/config.py`); do not edit by hand. tests/meta/test_docs.py fails when it is out of date. -->",
        "",
        "`Trainer(strategy=lightning_megatron.MegatronStrategy(name=value, ...))`; in a LightningCLI YAML "
        "`trainer.strategy.init_args.name: value` under `class_path: lightning_megatron.MegatronStrategy`; on the "
        "command line `--trainer.strategy.name value` (with `--trainer.strategy megatron` or a YAML that names the "
        "class). `Trainer(strategy=\"megatron\")` takes every default.",
        "",
        "The world size is `devices × num_nodes` (the Trainer's arguments). With `tp`, `pp`, `cp`, `ep`, `etp` the "
        "sizes below, the data-parallel size is `dp = world / (tp·cp·pp)` and the expert data-parallel size "
        "`edp = world / (etp·ep·pp)`; both must be whole numbers. Example: 16 GPUs (2 nodes × 8) with `tp=2, pp=2` "
        "give `dp=4`; adding `ep=4` (etp = tp = 2) gives `edp = 16 / (2·4·2) = 1`. "
        "`python -m lightning_megatron.parallel --world-size 16 --tp 2 --pp 2 --ep 4` prints every group.",
        "",
    ]
    for title, intro, names in groups(strategy):
        if not names:
            continue
        out += [f"## {title}", "", intro, "", "| argument | type | default | meaning | constraints |",
                "| --- | --- | --- | --- | --- |"]
        for name in names:
            parameter = parameters[name]
            meaning = meaning_of(name, documented)
            if not meaning:
                problems.append(f"{name}: no meaning (add it to MegatronStrategy's docstring Args:)")
                meaning = ""
            if name not in CONSTRAINTS:
                problems.append(f"{name}: no CONSTRAINTS entry in {os.path.relpath(__file__, ROOT)}")
            out.append(f"| `{name}` | {_cell(_type(parameter.annotation))} | {_cell(_default(parameter.default))} | "
                       f"{_cell(meaning)} | {_cell(CONSTRAINTS.get(name, ''))} |")
        out.append("")
    unknown = sorted((set(MISSING_DOCSTRINGS) | set(CONSTRAINTS)) - set(parameters))
    if unknown:
        problems.append(f"entries for arguments the strategy does not have: {unknown}")
    if problems:
        raise SystemExit("cannot document MegatronStrategy's arguments:\n  " + "\n  ".join(problems))
    return "\n".join(out).rstrip() + "\n"


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if the page is out of date, write nothing")
    args = parser.parse_args(argv)
    sys.path.insert(0, ROOT)
    text = render()
    current = open(PAGE, encoding="utf-8").read() if os.path.exists(PAGE) else ""
    if args.check:
        if current != text:
            print(f"{os.path.relpath(PAGE, ROOT)} is out of date: run `{COMMAND}`", file=sys.stderr)
            return 1
        return 0
    with open(PAGE, "w", encoding="utf-8", newline="\n") as f:
        f.write(text)
    print(f"wrote {os.path.relpath(PAGE, ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
