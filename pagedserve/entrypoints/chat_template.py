"""A conversation rendered by the tokenizer's chat template into prompt token ids.

Its own module, apart from the offline `LLM`, so that the server, which renders every chat
request, imports it without the engine core's model and runner code (those load in the
engine-core process only).
"""

from __future__ import annotations

from typing import Any

Message = dict[str, Any]

# apply_chat_template's own arguments: not variables a caller may set for the template
RESERVED_TEMPLATE_KWARGS = frozenset({
    "self", "conversation", "conversations", "messages", "tools", "documents", "chat_template",
    "add_generation_prompt", "continue_final_message", "tokenize", "sanitize_control_tokens",
    "padding", "truncation", "max_length", "return_tensors", "return_dict",
    "return_assistant_tokens_mask", "tokenizer_kwargs"})


def encode_chat(tokenizer, conversation: list[Message], add_generation_prompt: bool = True,
                tools: list[dict] | None = None, continue_final_message: bool = False,
                chat_template: str | None = None, template_kwargs: dict | None = None
                ) -> list[int]:
    """`tools`: OpenAI-style tool definitions for templates that render them;
    `continue_final_message`: the last message is left open, for the model to continue;
    `chat_template`: used instead of the tokenizer's; `template_kwargs`: variables the
    template reads (Qwen3's `enable_thinking`), never apply_chat_template's own arguments."""
    reserved = sorted(RESERVED_TEMPLATE_KWARGS & set(template_kwargs or ()))
    if reserved:
        raise ValueError(f"chat_template_kwargs may not set {', '.join(reserved)}: those are "
                         "apply_chat_template's own arguments")
    if chat_template is None and getattr(tokenizer, "chat_template", None) is None:
        raise ValueError("this model's tokenizer has no chat template; use generate()")
    text = tokenizer.apply_chat_template(conversation, tools=tools, tokenize=False,
                                         add_generation_prompt=add_generation_prompt,
                                         continue_final_message=continue_final_message,
                                         chat_template=chat_template, **(template_kwargs or {}))
    return tokenizer.encode(text, add_special_tokens=False)
