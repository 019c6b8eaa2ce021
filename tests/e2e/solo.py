"""What a chat request body gives when run alone in one process: the oracle the mesh's
answers are compared with."""

from __future__ import annotations

from typing import Any

from meshnet.engine.generate import generate
from meshnet.engine.local import LocalModel
from meshnet.model.chat import ChatMessage
from meshnet.model.sampling import SamplingParams


def solo_chat_ids(model: LocalModel, body: dict[str, Any]) -> list[int]:
    """The ids an OpenAI chat ``body`` generates in-process (its sampling fields honoured)."""
    msgs = [ChatMessage(m["role"], m["content"]) for m in body["messages"]]
    ids = model.tokenizer.encode(model.template.render(msgs))
    return generate(model.chain, model.tokenizer, ids, _params(body)).ids


def solo_completion_ids(model: LocalModel, body: dict[str, Any]) -> list[int]:
    """The ids a completion ``body`` generates in-process; a text prompt is encoded as
    the tracker encodes it (no special tokens added)."""
    prompt = body["prompt"]
    ids = model.tokenizer.encode(prompt) if isinstance(prompt, str) else prompt
    return generate(model.chain, model.tokenizer, ids, _params(body)).ids


def _params(body: dict[str, Any]) -> SamplingParams:
    return SamplingParams(
        max_tokens=body["max_tokens"],
        temperature=body.get("temperature", 1.0),
        top_p=body.get("top_p", 1.0),
        top_k=body.get("top_k", 0),
        repetition_penalty=body.get("repetition_penalty", 1.0),
        seed=body.get("seed"),
        presence_penalty=body.get("presence_penalty", 0.0),
        frequency_penalty=body.get("frequency_penalty", 0.0),
        logit_bias=tuple(sorted((int(k), v) for k, v in body.get("logit_bias", {}).items())),
        min_p=body.get("min_p", 0.0),
        ignore_eos=body.get("ignore_eos", False),
    )
