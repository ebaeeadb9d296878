"""GPT: vocab-parallel embedding + learned positions, causal transformer, tied output layer.

With ``TransformerConfig(position_embedding_type="rope")`` and ``tie_word_embeddings=False`` the same
class is a Llama (see ``models.llama``)."""

from __future__ import annotations

from typing import Any, Dict, Optional, Tuple

import torch
from torch import nn

from ..moe.pooled_aux_loss import check_pooled_layout
from ..parallel import chunk_position, get_parallel_state
from ..tensor_parallel import pad_vocab_size, vocab_parallel_cross_entropy
from ..transformer.config import with_strategy_defaults
from ..transformer import TransformerBlock, TransformerConfig
from ..tensor_parallel.fused_cross_entropy import LowPrecisionGemms, fused_kernels_run, parallel_linear_cross_entropy
from ..transformer.stage_costs import language_model_costs
from .embedding import LanguageModelEmbedding, output_weight_for_stage, parallel_logits
from .pipeline_layout import PipelineLayout, resolve_pipeline_layout


class GPTModel(nn.Module):
    """One pipeline chunk (``vp_rank``) of a GPT; with PP=1 the whole model.

    ``forward(input_ids [b, s], labels=None)``: on the last chunk the vocab-parallel logits
    ``[b, s, V_padded/tp]`` or, with ``labels``, the per-token loss ``[b, s]``; on other chunks
    the hidden states ``[s, b, h]`` for the next stage. Later chunks take their input from
    ``set_input_tensor`` (the pipeline executor's hand-over). Under context parallelism every
    ``[b, s]`` input is this rank's ``split_for_context_parallel`` slice, the loss covers this
    rank's tokens, and ``context_parallel_loss_mean`` turns it into the mean over all of them.
    Packed rows: ``position_ids`` restarting per document and ``document_ids [b, s]`` (0, 1, ... per
    document, -1 on padding; ``corpus.PackedDocuments``), which keep attention inside each document.

    ``cross_entropy_chunk_size``: with labels, compute the loss fused with the output layer over
    chunks of that many tokens (``tensor_parallel.fused_cross_entropy``), so the float32
    ``[s, b, V/tp]`` logits are never whole in the forward or the backward (several GB at large
    vocabularies), at the price of the output GEMM once more in the backward.
    ``fused_cross_entropy``: without a chunk size, the logits whole (in the model's dtype) and the loss
    and its gradient in one fused pass over them in the forward (no float32 softmax copies, no second
    pass in the backward: the fastest path); None (default): where its Triton kernels run (CUDA), else the
    unfused ``vocab_parallel_cross_entropy(logits)``; True/False to force it (True on the CPU: torch passes).
    ``TransformerConfig.final_logit_softcapping`` caps the logits on every one of these paths.

    ``pipeline_layout``: which layers each pipeline stage builds. None (default) or ``"balanced"``: stages
    balanced by counted cost at ``max_sequence_length`` (the embedding on the first, the output layer and
    loss on the last, dense and MoE layers each their own); ``"even"``: equal counts; a list: every virtual
    stage's count in model order (``pp·vpp`` entries). ``first_stage_layers``/``last_stage_layers`` pin the
    ends of the even split instead. The result is ``self.pipeline_layout``; checkpoints reshard across layouts.
    """

    # the last stage's copy of the tied table is this weight in the single-process model
    tied_weights = {"output_weight": "embedding.word_embeddings.weight"}
    hf_config: Dict[str, Any]   # set by models.hf_llama.load_hf_llama: the imported config.json (exports keep its keys)

    def __init__(self, config: TransformerConfig, vocab_size: int, max_sequence_length: int,
                 vp_rank: int = 0, tie_word_embeddings: bool = True, label_smoothing: float = 0.0,
                 first_stage_layers: Optional[int] = None, last_stage_layers: Optional[int] = None,
                 cross_entropy_chunk_size: Optional[int] = None, fused_cross_entropy: Optional[bool] = None,
                 pipeline_layout: PipelineLayout = None) -> None:
        super().__init__()
        if config.attn_mask_type != "causal":
            raise ValueError("GPTModel needs TransformerConfig(attn_mask_type='causal').")
        config = with_strategy_defaults(config)
        self.config = config
        self.vocab_size = vocab_size
        self.max_sequence_length, self.tie_word_embeddings = max_sequence_length, tie_word_embeddings
        self.padded_vocab_size = pad_vocab_size(vocab_size, get_parallel_state().tp_size)
        self.label_smoothing = label_smoothing
        if cross_entropy_chunk_size is not None and (isinstance(cross_entropy_chunk_size, bool) or not isinstance(
                cross_entropy_chunk_size, int) or cross_entropy_chunk_size < 1):
            raise ValueError(f"GPTModel cross_entropy_chunk_size must be a positive number of tokens or None (the "
                             f"unfused loss), got {cross_entropy_chunk_size!r}.")
        if fused_cross_entropy not in (None, True, False):
            raise ValueError(f"GPTModel fused_cross_entropy must be None (fused where its kernels run), True or "
                             f"False, got {fused_cross_entropy!r}.")
        if fused_cross_entropy is False and cross_entropy_chunk_size is not None:
            raise ValueError(f"GPTModel cross_entropy_chunk_size={cross_entropy_chunk_size} fuses the loss with the "
                             f"output layer, fused_cross_entropy=False asks for the unfused loss: drop one of them.")
        self.cross_entropy_chunk_size = cross_entropy_chunk_size
        self.fused_cross_entropy = fused_cross_entropy
        self.pre_process, self.post_process = chunk_position(vp_rank)
        self.input_tensor: Optional[torch.Tensor] = None

        if self.pre_process:
            self.embedding = LanguageModelEmbedding(config, vocab_size, self.padded_vocab_size,
                                                    max_sequence_length)
        self.pipeline_layout: Tuple[int, ...] = resolve_pipeline_layout(
            pipeline_layout, config.num_layers,
            lambda: language_model_costs(config, max_sequence_length, vocab_size,
                                         recompute_output_layer=cross_entropy_chunk_size is not None),
            first_stage_layers, last_stage_layers)
        state = get_parallel_state()
        check_pooled_layout(config, self.pipeline_layout, state.pp_size, state.virtual_pipeline_size)
        self.decoder = TransformerBlock(config, vp_rank, pipeline_layout=self.pipeline_layout)
        self.output_weight: Optional[nn.Parameter] = None
        # the output projection's GEMMs in float8 (enable_fp8 with Float8Config(output_layer=True)), else None
        self.output_float8: Optional[LowPrecisionGemms] = None
        if self.post_process and not (tie_word_embeddings and self.pre_process):
            self.output_weight = output_weight_for_stage(config, vocab_size, self.padded_vocab_size,
                                                         tie_word_embeddings)
        if tie_word_embeddings and self.pre_process and not self.post_process:
            # shared_embedding: a runtime attribute (pipeline/shared_embeddings.py reads it)
            self.embedding.word_embeddings.weight.shared_embedding = True  # type: ignore[attr-defined]

    def set_input_tensor(self, tensor: Optional[torch.Tensor]) -> None:
        self.input_tensor = tensor

    def forward(self, input_ids: torch.Tensor, position_ids: Optional[torch.Tensor] = None,
                attention_mask: Optional[torch.Tensor] = None,
                labels: Optional[torch.Tensor] = None,
                document_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
        moe = self.config.moe
        if attention_mask is not None and moe is not None and moe.aux_loss_type == "hf_pooled" and \
                moe.aux_loss_coeff > 0 and self.training:
            raise ValueError("GPTModel.forward with attention_mask under aux_loss_type='hf_pooled' (transformers' "
                             "balancing loss, which leaves the masked tokens out): the routers here see no mask, so "
                             "padding would count; train on packed rows (document_ids, no padding), or with "
                             "MoEConfig(aux_loss_type='per_layer') or router_aux_loss_coef 0.")
        if self.pre_process:
            hidden = self.embedding(input_ids, position_ids)
        else:
            hidden = self.input_tensor
        # every stage gets the micro-batch's position_ids (rotary angles) and document_ids (packed rows'
        # attention masks) from the caller, as it gets input_ids: nothing extra travels between stages
        rotary_positions = position_ids if self.config.position_embedding_type == "rope" else None
        hidden = self.decoder(hidden, attention_mask, rotary_positions, document_ids)
        if not self.post_process:
            return hidden
        weight = self.output_weight if self.output_weight is not None else self.embedding.word_embeddings.weight
        capping = self.config.final_logit_softcapping
        fused = self.cross_entropy_chunk_size is not None or self.fused_cross_entropy or (
            self.fused_cross_entropy is None and fused_kernels_run(hidden))
        if labels is not None and fused:   # the loss fused with the output layer (chunked: logits never whole)
            return parallel_linear_cross_entropy(
                hidden, weight, labels.t(), self.config.sequence_parallel, label_smoothing=self.label_smoothing,
                vocab_size=self.vocab_size, chunk_size=self.cross_entropy_chunk_size, logit_softcapping=capping,
                low_precision=self.output_float8).t()
        logits = parallel_logits(hidden, weight, self.config.sequence_parallel,            # [s, b, V/tp]
                                 matmul=self.output_float8)
        if capping is not None:   # Gemma 2: elementwise, so each tp rank caps its own vocabulary slice
            logits = torch.tanh(logits / capping) * capping
        if labels is None:
            return logits.transpose(0, 1).contiguous()
        loss = vocab_parallel_cross_entropy(logits, labels.t(), label_smoothing=self.label_smoothing,
                                            vocab_size=self.vocab_size)
        return loss.t()
