"""Chat fine-tuning: JSONL conversations through the tokenizer's own chat template, loss on the assistant's
tokens only, packed rows with attention inside each conversation, a Hugging Face Llama-family model imported at
any layout and exported back (``examples/chat_tiny.yaml``).

``python -m lightning_megatron.recipes.chat.sample OUT`` writes a tiny random model, its chat tokenizer and
sample conversations.
"""

from .conversations import Conversation, read_conversations
from .datamodule import ChatData
from .module import ChatFinetuning
from .packing import PackedConversations, PackingStats
from .template import encode_conversation, load_chat_tokenizer

__all__ = ["ChatData", "ChatFinetuning", "Conversation", "PackedConversations", "PackingStats",
           "encode_conversation", "load_chat_tokenizer", "read_conversations"]
