"""Prompts: the chat template, encoding, middle truncation to a length, and left padding."""

from ..lazy import torch


def middle_truncate(ids, max_len):
    """Keep the first ``ceil(max_len/2)`` and last ``floor(max_len/2)`` items of ``ids`` if longer than ``max_len``.

    ``ids`` is a list or a 1-D tensor ``[n]``; the result is of the same kind.
    """
    if max_len < 1:
        raise ValueError(f"max_len must be >= 1, got {max_len}")
    if len(ids) <= max_len:
        return ids
    head = (max_len + 1) // 2
    tail = max_len - head
    if tail == 0:
        return ids[:head]
    if isinstance(ids, list):
        return ids[:head] + ids[-tail:]
    return torch.cat([ids[:head], ids[-tail:]])


def has_chat_template(tokenizer):
    return bool(getattr(tokenizer, "chat_template", None))


def build_prompt(tokenizer, text, chat_template="auto"):
    """Wrap ``text`` as one user turn in the model's chat template.

    Parameters
    ----------
    chat_template : {"auto", "on", "off"} or bool
        ``auto`` applies the template when the tokenizer has one; ``on``
        requires one; ``off`` returns ``text`` unchanged.
    """
    mode = {True: "on", False: "off"}.get(chat_template, chat_template)
    if mode not in ("auto", "on", "off"):
        raise ValueError(f"chat_template must be auto/on/off, got {chat_template!r}")
    if mode == "off" or (mode == "auto" and not has_chat_template(tokenizer)):
        return text
    if not has_chat_template(tokenizer):
        raise ValueError("chat_template: 'on' but the tokenizer has no chat template")
    return tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
    )


def encode(tokenizer, text, offsets=False):
    """Token ids of ``text``; the tokenizer's special tokens are added unless the text already starts with BOS.

    With ``offsets=True`` returns ``(ids, [(char_start, char_end), ...])``.
    """
    bos = getattr(tokenizer, "bos_token", None)
    add = not (bos and text.startswith(bos))
    enc = tokenizer(text, add_special_tokens=add, return_offsets_mapping=offsets)
    return (enc.input_ids, [tuple(o) for o in enc.offset_mapping]) if offsets else enc.input_ids


def left_pad(tokenizer, prompts, device):
    """Encode and left-pad a batch of prompts.

    Parameters
    ----------
    prompts : list of str or list of list of int
        Texts (encoded with :func:`encode`) or token ids.

    Returns
    -------
    input_ids, attention_mask : torch.LongTensor
        ``[batch, width]`` on ``device``, ``width`` the longest prompt; the mask is 0 on the padding.
    pad_token_id : int
        The tokenizer's pad token (its EOS token when it has none).
    """
    ids = [encode(tokenizer, p) if isinstance(p, str) else list(p) for p in prompts]
    width = max(len(x) for x in ids)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    rows = [[pad] * (width - len(x)) + x for x in ids]
    held = [[0] * (width - len(x)) + [1] * len(x) for x in ids]
    input_ids = torch.tensor(rows, dtype=torch.long, device=device)
    mask = torch.tensor(held, dtype=torch.long, device=device)
    return input_ids, mask, pad


def split_prompt(tokenizer, prompt, char):
    """Token ids of a built prompt and where its question starts: the index of the token holding
    character ``char`` of ``prompt``, kept in ``[1, len - 1]`` (the context and the question are never empty).
    """
    ids, offsets = encode(tokenizer, prompt, offsets=True)
    start = next((i for i, (_, end) in enumerate(offsets) if end > char), len(ids))
    return ids, max(1, min(start, len(ids) - 1))


def fit_text(tokenizer, text, max_length, chat_template, reserve=0, beside=0):
    """``text`` middle-truncated (in tokens) so that it, ``beside`` more tokens (a question read after it), the
    chat template's own tokens and ``reserve`` (new tokens) fit ``max_length``.

    Raises
    ------
    ValueError
        When no room is left for the text.
    """
    overhead = len(encode(tokenizer, build_prompt(tokenizer, "", chat_template)))
    cap = max_length - reserve - overhead - beside
    if cap < 1:
        more = f", a question of {beside} tokens" if beside else ""
        raise ValueError(
            f"max_length {max_length} leaves no room for the prompt "
            f"({reserve} new tokens, {overhead} template tokens{more})"
        )
    ids = tokenizer(text, add_special_tokens=False).input_ids
    if len(ids) > cap:
        text = tokenizer.decode(middle_truncate(ids, cap), skip_special_tokens=True)
    return text


def prompt_ids(tokenizer, text, max_length, chat_template, reserve=0, question=None):
    """Token ids of one prompt: middle-truncate ``text``, then apply the chat template.

    Parameters
    ----------
    tokenizer : PreTrainedTokenizer
    text : str
        The filled template.
    max_length : int
        Cap on the tokens of ``text`` plus ``reserve`` plus the chat template's own tokens.
    chat_template : {"auto", "on", "off"}
    reserve : int
        Tokens kept free (for generation).
    question : str, optional
        The end of ``text`` that is its question (the template's text after the context); then where it
        starts is returned too (:func:`split_prompt`).

    Returns
    -------
    list of int, or (list of int, int) with ``question``

    Raises
    ------
    ValueError
        When no room is left, or the truncated text no longer ends with ``question``.
    """
    text = fit_text(tokenizer, text, max_length, chat_template, reserve)
    prompt = build_prompt(tokenizer, text, chat_template)
    if question is None:
        return encode(tokenizer, prompt)
    if not text.endswith(question):
        raise ValueError(
            f"the prompt no longer ends with its question after truncation to {max_length} tokens"
        )
    return split_prompt(tokenizer, prompt, prompt.rfind(text) + len(text) - len(question))


MARK = "\u2063\u2063restkv-question\u2063\u2063"  # splits a built prompt where the question starts


def context_and_questions(tokenizer, context, questions, max_length, chat_template, reserve=0):
    """Token ids of a context to compress once and of the questions read after it (SCBench's shared context).

    Each question's prompt is ``context + question`` as one user turn of the chat template; the built
    prompt's text before the question is the context's (the same for every question), the rest (the
    question, the template's closing tokens) is the question's, encoded without special tokens. The context
    is middle-truncated so that it, the longest question, the template and ``reserve`` fit ``max_length``.

    Returns
    -------
    (list of int, list of list of int)
        The context's ids and each question's ids.

    Raises
    ------
    ValueError
        When no room is left for the context, or the chat template renders the context differently
        for different questions.
    """
    if not questions:
        raise ValueError("a shared context needs at least one question")
    longest = max(len(tokenizer(q, add_special_tokens=False).input_ids) for q in questions)
    context = fit_text(tokenizer, context, max_length, chat_template, reserve, longest)
    parts = [build_prompt(tokenizer, context + MARK + q, chat_template).split(MARK) for q in questions]
    if any(len(p) != 2 or p[0] != parts[0][0] for p in parts):
        raise ValueError("the chat template renders the shared context differently for different questions")
    return encode(tokenizer, parts[0][0]), [tokenizer(tail, add_special_tokens=False).input_ids for _, tail in parts]
