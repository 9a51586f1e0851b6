"""Chat messages as the model's chat template takes them: checked, each content one str;
and the template applied."""
import os

from jaxllm.engine.processor import check_text


def chat_messages(i: int, conversation) -> list[dict]:
    """Conversation i's messages, each content a str (OpenAI text parts joined); a
    TypeError or ValueError naming the conversation and message if one is malformed."""
    if not isinstance(conversation, (list, tuple)):
        raise TypeError(f"conversation {i} must be a list of message dicts, got {type(conversation).__name__}")
    if not conversation:
        raise ValueError(f"conversation {i} is empty: it needs at least one message")
    messages = []
    for j, message in enumerate(conversation):
        where = f"conversation {i}, message {j}"
        if not isinstance(message, dict):
            raise TypeError(f"{where} must be a dict with 'role' and 'content', got {type(message).__name__}")
        if "role" not in message or "content" not in message:
            raise ValueError(f"{where} needs 'role' and 'content', got keys {list(message)}")
        if not isinstance(message["role"], str):
            raise TypeError(f"{where}: role must be a str, got {type(message['role']).__name__}")
        content = content_text(where, message["content"])
        check_text(content, f"{where}: content")
        messages.append({**message, "content": content})
    return messages


def content_text(where: str, content) -> str:
    """A message's content as one str: a str as it is, OpenAI text parts joined by newlines."""
    if isinstance(content, str):
        return content
    if not isinstance(content, (list, tuple)):
        raise TypeError(f"{where}: content must be a str or a list of text parts, got {type(content).__name__}")
    texts = []
    for k, part in enumerate(content):
        if not isinstance(part, dict):
            raise TypeError(f"{where}: content part {k} must be a dict, got {type(part).__name__}")
        if part.get("type") != "text":
            raise ValueError(f"{where}: content part {k} has type {part.get('type')!r}; only 'text' parts "
                             "are supported")
        if not isinstance(part.get("text"), str):
            raise TypeError(f"{where}: content part {k}: text must be a str, got {type(part.get('text')).__name__}")
        texts.append(part["text"])
    return "\n".join(texts)


def load_chat_template(template: str | None) -> str | None:
    """`--chat-template`: a file's path, or the Jinja template itself; None: the tokenizer's."""
    if template is None or "{" in template:
        return template
    if not os.path.isfile(template):
        raise ValueError(f"chat template {template!r} is neither a file nor a Jinja template")
    with open(template, encoding="utf-8") as f:
        return f.read()


def apply_chat_template(tokenizer, messages: list[dict], chat_template: str | None = None,
                        add_generation_prompt: bool = True, continue_final_message: bool = False,
                        chat_template_kwargs: dict | None = None, tools: list[dict] | None = None) -> tuple[str, list[int]]:
    """The conversation as the model's prompt: (text, token ids). The template adds the
    special tokens it wants (BOS among them), so encoding adds none; it renders `tools`
    (OpenAI's function tools) as its model expects them. A template error, or a tokenizer
    with no template, raises ValueError."""
    if tokenizer is None:
        raise ValueError("chat needs a tokenizer, and this engine was started with skip_tokenizer_init")
    if add_generation_prompt and continue_final_message:
        raise ValueError("add_generation_prompt and continue_final_message cannot both be true")
    kwargs = dict(chat_template_kwargs or {})
    for reserved in ("conversation", "tokenize", "chat_template", "add_generation_prompt",
                     "continue_final_message", "tools"):
        if reserved in kwargs:
            raise ValueError(f"chat_template_kwargs cannot set {reserved!r}")
    try:
        text = tokenizer.apply_chat_template(messages, chat_template=chat_template, tokenize=False,
                                             add_generation_prompt=add_generation_prompt,
                                             continue_final_message=continue_final_message, tools=tools,
                                             **kwargs)
    except ValueError:
        raise
    except Exception as e:  # jinja2's TemplateError and what a template raises
        raise ValueError(f"the chat template failed: {type(e).__name__}: {e}") from e
    return text, tokenizer.encode(text, add_special_tokens=False)
