#!/usr/bin/env bash
# A walk-through of README.md and examples/ on a CPU machine: the README's commands, its "Use it"
# program, and every recipe at 1 and 2 CPU ranks with tiny sizes, stopping at the first failure.
#
#   bash examples/smoke.sh            # everything: 26 steps, about 10 minutes on 2 CPU cores
#   bash examples/smoke.sh --fast     # what no test runs: 4 steps, 1 minute on 2 idle cores, 2 when busy;
#                                     # CI runs it (tests/integration/recipes/test_smoke.py)
#   bash examples/smoke.sh --install  # first the README's install command (a clean machine)
#
# Each step prints its command and the line that shows it worked; a failing step prints the end of
# its output and the script exits 1. Logs, checkpoints and data go to a temporary folder, removed at
# the end (set SMOKE_KEEP=1 to keep it). PYTHON chooses the interpreter (default: python).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
FAST=0
INSTALL=0
for arg in "$@"; do
    case "$arg" in
        --fast) FAST=1 ;;
        --install) INSTALL=1 ;;
        -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
        *) echo "smoke.sh: unknown option $arg (use --fast, --install or --help)" >&2; exit 2 ;;
    esac
done

PYTHON="${PYTHON:-python}"
WORK="$(mktemp -d "${TMPDIR:-/tmp}/lm_smoke.XXXXXX")"
if [[ "${SMOKE_KEEP:-0}" == 1 ]]; then echo "smoke: keeping $WORK"; else trap 'rm -rf "$WORK"' EXIT; fi
trap 'exit 130' INT TERM   # through the EXIT trap
# The processes a launcher (torchrun, srun, a test harness) may have given us must not reach the steps:
# with LOCAL_RANK set, Lightning would take each command for one rank of a bigger run.
unset RANK LOCAL_RANK WORLD_SIZE LOCAL_WORLD_SIZE GROUP_RANK NODE_RANK MASTER_ADDR MASTER_PORT
for name in $(env | grep -o '^SLURM_[A-Z_]*' || true); do unset "$name"; done
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"   # this checkout, installed or not
export PYTHONUNBUFFERED=1
export LIGHTNING_MEGATRON_TRACEBACK=1                 # a failing step shows where
LM=("$PYTHON" -m lightning_megatron)
STEPS=0
START=$SECONDS

fail() {   # fail NAME LOG WHY
    echo "smoke: FAILED: $1: $3; the end of its output ($2):" >&2
    tail -n 40 "$2" >&2
    exit 1
}

step() {   # step NAME REGEX COMMAND...: run COMMAND; it must succeed and print a line matching REGEX (if not "")
    local name="$1" expect="$2" log rc t0=$SECONDS
    shift 2
    STEPS=$((STEPS + 1))
    log="$WORK/step$STEPS.log"
    echo "smoke [$STEPS] $name"
    echo "    \$ ${*/#$ROOT\//}"
    "$@" > "$log" 2>&1 || { rc=$?; fail "$name" "$log" "exit status $rc"; }
    if [[ -z "$expect" ]]; then echo "    ok ($((SECONDS - t0)) s)"; return; fi
    grep -Eq -- "$expect" "$log" || fail "$name" "$log" "no line matches /$expect/"
    echo "    ok ($((SECONDS - t0)) s): $(grep -E -- "$expect" "$log" | tail -n 1 | cut -c1-160)"
}

two_slurm_tasks() {   # two_slurm_tasks LOG COMMAND...: COMMAND as the 2 tasks of a one-node SLURM job
    # srun's variables, as SLURM sets them: Lightning's SLURMEnvironment takes over. MASTER_PORT: a free
    # port rather than the one SLURM_JOB_ID gives, which another run may hold.
    local log="$1" port pids=() status=0 r
    shift
    port="$("$PYTHON" -c "import socket; s = socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])")"
    for r in 0 1; do
        env SLURM_NTASKS=2 SLURM_NTASKS_PER_NODE=2 SLURM_NNODES=1 SLURM_NODEID=0 SLURM_PROCID=$r SLURM_LOCALID=$r \
            SLURM_JOB_NAME=smoke SLURM_JOB_ID=4242 SLURM_NODELIST=127.0.0.1 MASTER_PORT="$port" "$@" \
            > "$log.task$r" 2>&1 &
        pids+=($!)
    done
    for r in 0 1; do wait "${pids[$r]}" || status=1; done
    cat "$log".task*
    return $status
}

fit() {   # fit NAME REGEX RUN_DIR ARGS...: python -m lightning_megatron fit ARGS, logs under RUN_DIR
    local name="$1" expect="$2" dir="$WORK/$3"
    shift 3
    step "$name" "$expect" "${LM[@]}" fit "$@" --trainer.default_root_dir "$dir" --trainer.enable_progress_bar false
}

# -- the README: install, then the first command ------------------------------------------------------
if [[ $INSTALL == 1 ]]; then
    step "README: install" "Successfully installed|already satisfied" \
        bash -c "pip install torch==2.13.0 && pip install -e ."
fi
# 4 of the 18 steps of an epoch, then 2 batches of each dev set (too few to learn: the accuracy is not the point)
TINY_MNLI=(--trainer.max_steps 4 --trainer.val_check_interval 4 --trainer.limit_val_batches 2)
if [[ $FAST == 1 ]]; then
    fit "README: the first command (4 steps)" "dev accuracy \(epoch 0, step 4\): matched" mnli_tiny \
        --config examples/mnli_tiny.yaml "${TINY_MNLI[@]}"
else
    step "the package imports and registers strategy=\"megatron\"" "^megatron$" \
        "$PYTHON" -c "import lightning_megatron; from lightning.pytorch.strategies import StrategyRegistry; \
print('megatron' if 'megatron' in StrategyRegistry else 'missing')"
    # as typed (3 epochs); the accuracy it documents (0.88 / 0.86; chance 0.33)
    fit "README: the first command" "dev accuracy \(epoch 2, step 54\): matched (0\.[7-9]|1\.0)" mnli_tiny \
        --config examples/mnli_tiny.yaml
    fit "README: the first command at tensor parallelism 2 (2 ranks)" \
        "dev accuracy \(epoch 2, step 54\): matched (0\.[7-9]|1\.0)" mnli_tiny_tp2 \
        --config examples/mnli_tiny.yaml --trainer.devices 2 --trainer.strategy.tensor_model_parallel_size 2
    fit "mnli_tiny.yaml, data parallel (2 ranks, 4 steps)" "dev accuracy \(epoch 0, step 4\)" mnli_tiny_dp2 \
        --config examples/mnli_tiny.yaml --trainer.devices 2 "${TINY_MNLI[@]}"
    # (no micro_batch_size: it must divide every batch, and each dev set's last batch holds 6 pairs)
    fit "mnli_tiny.yaml, pipeline parallel (2 ranks, 4 steps)" "dev accuracy \(epoch 0, step 4\)" mnli_tiny_pp2 \
        --config examples/mnli_tiny.yaml --trainer.devices 2 --trainer.strategy.pipeline_model_parallel_size 2 \
        "${TINY_MNLI[@]}"
fi

# -- the paper's recipes, at CPU sizes: the random-init BERT on the shipped sample / a tiny RACE folder ---
CPU_BERT=(--trainer.accelerator cpu --trainer.precision 32-true --trainer.max_steps 2 --trainer.val_check_interval 2
          --trainer.limit_val_batches 2 --trainer.log_every_n_steps 1 --model.pretrained null
          --model.random_init.num_layers 2 --model.random_init.hidden_size 64
          --model.random_init.num_attention_heads 4 --data.num_workers 0)
MNLI_CPU=(--config examples/mnli.yaml "${CPU_BERT[@]}" --data.data_dir null --data.tokenizer null --data.batch_size 16)
"$PYTHON" - "$WORK/race" <<'EOF'
import json, os, random, sys
# RACE's layout (train/ and dev/, each with middle/ and high/ JSON files), words of the shipped sample's vocabulary
rng = random.Random(0)
places, things = ["market", "garden", "harbor", "station"], ["map", "key", "lamp", "sword", "camera", "ticket"]
for split in ("train", "dev"):
    for level in ("middle", "high"):
        os.makedirs(os.path.join(sys.argv[1], split, level))
        for i in range(8):
            answer, options = rng.randrange(4), rng.sample(things, 3)
            options.insert(answer, rng.choice(places))
            with open(os.path.join(sys.argv[1], split, level, f"{i}.txt"), "w") as f:
                json.dump({"id": f"{level}{i}.txt", "article": "the baker went to the market with a key .",
                           "questions": ["where did the baker go ?"], "options": [options],
                           "answers": ["ABCD"[answer]]}, f)
EOF
RACE_CPU=(--config examples/race.yaml "${CPU_BERT[@]}" --data.data_dir "$WORK/race"
          --data.tokenizer lightning_megatron/recipes/data/sample --data.batch_size 4 --data.eval_batch_size 4
          --data.max_seq_length 64 --data.max_qa_length 16)
fit "mnli.yaml at its layout, tensor parallel 2 (2 CPU ranks, 2 steps)" "dev accuracy \(epoch 0, step 2\)" mnli_tp2 \
    "${MNLI_CPU[@]}"
fit "race.yaml at its layout, tensor parallel 2 (2 CPU ranks, 2 steps)" "dev accuracy \(epoch 0, step 2\)" race_tp2 \
    "${RACE_CPU[@]}"
if [[ $FAST == 0 ]]; then
    fit "mnli.yaml on 1 CPU rank (2 steps)" "dev accuracy \(epoch 0, step 2\)" mnli_1 \
        "${MNLI_CPU[@]}" --trainer.devices 1 --trainer.strategy.tensor_model_parallel_size 1
    fit "race.yaml on 1 CPU rank (2 steps)" "dev accuracy \(epoch 0, step 2\)" race_1 \
        "${RACE_CPU[@]}" --trainer.devices 1 --trainer.strategy.tensor_model_parallel_size 1
fi

# -- the GPT and Llama recipes ---------------------------------------------------------------------------
# (tests/integration/recipes/test_cli.py runs gpt_tiny at 1 rank, TP2 and DP2, gpt_moe_tiny at EP2)
TINY_GPT=(--trainer.max_steps 4 --trainer.val_check_interval 4 --data.train_size 128 --data.val_size 32)
fit "gpt_tiny.yaml, pipeline parallel 2 with 2 micro-batches (2 ranks, 4 steps)" "^final .*train_loss=" gpt_pp2 \
    --config examples/gpt_tiny.yaml --trainer.devices 2 --trainer.strategy.pipeline_model_parallel_size 2 \
    --trainer.strategy.micro_batch_size 8 "${TINY_GPT[@]}"
if [[ $FAST == 0 ]]; then
    fit "gpt_tiny.yaml (1 rank)" "^final .*train_loss=" gpt_1 --config examples/gpt_tiny.yaml "${TINY_GPT[@]}"
    fit "gpt_tiny.yaml, data parallel (2 ranks)" "^final .*train_loss=" gpt_dp2 --config examples/gpt_tiny.yaml \
        --trainer.devices 2 "${TINY_GPT[@]}"
    fit "gpt_tiny.yaml, tensor parallel (2 ranks)" "^final .*train_loss=" gpt_tp2 --config examples/gpt_tiny.yaml \
        --trainer.devices 2 --trainer.strategy.tensor_model_parallel_size 2 "${TINY_GPT[@]}"
    fit "gpt_moe_tiny.yaml (1 rank)" "^final .*train_loss=" moe_1 --config examples/gpt_moe_tiny.yaml "${TINY_GPT[@]}"
    fit "gpt_moe_tiny.yaml, expert parallel 2 with one ECHO spare slot per rank (2 ranks)" "^final .*train_loss=" \
        moe_ep2 --config examples/gpt_moe_tiny.yaml --trainer.devices 2 \
        --trainer.strategy.expert_model_parallel_size 2 --model.moe.num_spare_experts_per_ep_rank 1 \
        --data.batch_size 8 "${TINY_GPT[@]}"
    # its corpus and tokenizer are generated on first use: into the temporary folder, not ./data
    LLAMA_DATA=(--data.train_prefixes "[$WORK/llama/train]" --data.valid_prefixes "[$WORK/llama/valid]"
                --data.sample_corpus "$WORK/llama")
    fit "llama_tiny.yaml (1 rank)" "^final .*train_loss=" llama_1 --config examples/llama_tiny.yaml \
        --trainer.max_steps 4 --trainer.val_check_interval 4 "${LLAMA_DATA[@]}"
    fit "llama_tiny.yaml, tensor parallel (2 ranks)" "^final .*train_loss=" llama_tp2 --config examples/llama_tiny.yaml \
        --trainer.devices 2 --trainer.strategy.tensor_model_parallel_size 2 --trainer.max_steps 4 \
        --trainer.val_check_interval 4 "${LLAMA_DATA[@]}"
    # (tests/integration/recipes/test_chat_recipe.py runs chat_tiny at PP2) its tiny model, chat tokenizer and
    # conversations are generated on first use: into the temporary folder, not ./data
    CHAT_DATA=(--model.pretrained "$WORK/chat/model" --model.export_dir "$WORK/chat/export"
               --data.train_files "[$WORK/chat/train.jsonl]" --data.valid_files "[$WORK/chat/valid.jsonl]"
               --data.tokenizer "$WORK/chat/model" --data.sample "$WORK/chat" --trainer.max_steps 4
               --trainer.val_check_interval 4)
    fit "chat_tiny.yaml (1 rank)" "^exported the fine-tuned model to " chat_1 --config examples/chat_tiny.yaml \
        "${CHAT_DATA[@]}"
    fit "chat_tiny.yaml, tensor parallel (2 ranks)" "^final .*val_loss=" chat_tp2 --config examples/chat_tiny.yaml \
        --trainer.devices 2 --trainer.strategy.tensor_model_parallel_size 2 "${CHAT_DATA[@]}"
fi

# -- the rest of the README and docs/launching.md -----------------------------------------------------------
if [[ $FAST == 0 ]]; then
    # the README's complete programs (tests/meta/test_docs.py runs them too), each in its own folder
    step "README: its programs, written out" "readme_1\.py" "$PYTHON" -c "import sys; sys.path[:0] = ['tests/meta', 'tests']; \
from test_docs import write_readme_programs; print(*write_readme_programs(sys.argv[1]), sep='\n')" "$WORK/readme"
    for program in "$WORK"/readme/readme_*.py; do
        step "README: $(basename "$program")" "" bash -c 'cd "$(dirname "$1")" && "$2" "$1"' _ "$program" "$PYTHON"
    done
    step "the layout printer" "^rank 5: " "$PYTHON" -m lightning_megatron.parallel --world-size 16 --tp 4 --pp 2 \
        --ep 4 --etp 1 --rank 5
    CKPT="$(find "$WORK/gpt_dp2" -name '*.ckpt' | head -n 1)"
    step "README: consolidate a sharded checkpoint" "" "$PYTHON" -m lightning_megatron.checkpoint consolidate \
        "$CKPT" "$WORK/consolidated.pt"
    [[ -s "$WORK/consolidated.pt" ]] || fail "consolidate" "$WORK/step$STEPS.log" "no $WORK/consolidated.pt"
    step "docs/launching.md: torchrun --nproc-per-node 2 (tensor parallel 2)" "^final .*train_loss=" \
        "$PYTHON" -m torch.distributed.run --standalone --nproc-per-node 2 -m lightning_megatron fit --config examples/gpt_tiny.yaml \
        --trainer.devices 2 --trainer.strategy.tensor_model_parallel_size 2 "${TINY_GPT[@]}" \
        --trainer.default_root_dir "$WORK/torchrun" --trainer.enable_progress_bar false
    step "docs/launching.md: the ranks of a SLURM job (2 tasks started as srun starts them)" "^final .*train_loss=" \
        two_slurm_tasks "$WORK/slurm" "${LM[@]}" fit --config examples/gpt_tiny.yaml --trainer.devices 2 \
        --trainer.strategy.tensor_model_parallel_size 2 "${TINY_GPT[@]}" --trainer.default_root_dir "$WORK/slurm" \
        --trainer.enable_progress_bar false
fi

echo "smoke: all $STEPS steps passed in $((SECONDS - START)) s ($([[ $FAST == 1 ]] && echo fast || echo full) mode)"
