"""The "we just wrapped the model" baseline: FastAPI + transformers ``generate``, one request at
a time (a lock), OpenAI-shaped ``/v1/completions`` and ``/v1/chat/completions`` with streaming.

    python benchmarks/peers/hf_server.py [--model smollm2-135m-instruct | PATH] [--port 8001]

MODEL is a .gguf file, a Hugging Face directory or tokenmill's known name (resolved locally).
This is what serving engines exist to replace; it is a benchmark peer, never used by tests of
the engine itself.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import threading
import time
import uuid

import torch
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse


def load(model: str):
    import transformers

    from tokenmill.model_source import resolve_model

    src = resolve_model(model)
    kw = {"gguf_file": src.path.name} if src.kind == "gguf" else {}
    where = str(src.path.parent if src.kind == "gguf" else src.path)
    tok = transformers.AutoTokenizer.from_pretrained(where, **kw)
    lm = transformers.AutoModelForCausalLM.from_pretrained(where, dtype=torch.float32, **kw)
    return tok, lm.eval()


def build_app(tok, lm, served_name: str) -> FastAPI:
    app = FastAPI()
    lock = asyncio.Lock()  # one request at a time: the point of this baseline

    async def handle(body: dict, chat: bool):
        if chat:
            prompt = tok.apply_chat_template(body["messages"], tokenize=False,
                                             add_generation_prompt=True)
            ids = tok(prompt, add_special_tokens=False)["input_ids"]
        else:
            ids = tok(body["prompt"])["input_ids"]
        max_tokens = int(body.get("max_tokens") or 16)
        gen = dict(max_new_tokens=max_tokens, pad_token_id=tok.eos_token_id)
        temperature = float(body.get("temperature", 1.0))
        gen.update(do_sample=temperature > 0, **({"temperature": temperature}
                                                  if temperature > 0 else {}))
        if body.get("ignore_eos"):
            gen["min_new_tokens"] = max_tokens
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        if body.get("stream"):
            return StreamingResponse(stream(rid, ids, gen, chat, body),
                                     media_type="text/event-stream")
        async with lock:
            out = await asyncio.to_thread(run, ids, gen)
        text = tok.decode(out, skip_special_tokens=True)
        choice = ({"index": 0, "message": {"role": "assistant", "content": text},
                   "finish_reason": "length" if len(out) == max_tokens else "stop"} if chat else
                  {"index": 0, "text": text,
                   "finish_reason": "length" if len(out) == max_tokens else "stop"})
        return JSONResponse({"id": rid, "object": "chat.completion" if chat else "text_completion",
                             "model": served_name, "choices": [choice],
                             "usage": usage(len(ids), len(out))})

    def run(ids: list[int], gen: dict, streamer=None) -> list[int]:
        with torch.no_grad():
            out = lm.generate(torch.tensor([ids]), streamer=streamer, **gen)
        return out[0, len(ids):].tolist()

    def usage(p: int, c: int) -> dict:
        return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}

    async def stream(rid: str, ids: list[int], gen: dict, chat: bool, body: dict):
        from transformers import TextIteratorStreamer

        async with lock:
            streamer = TextIteratorStreamer(tok, skip_prompt=True, skip_special_tokens=True)
            result: dict = {}
            worker = threading.Thread(
                target=lambda: result.setdefault("ids", run(ids, gen, streamer)))
            worker.start()
            it = iter(streamer)
            while True:
                piece = await asyncio.to_thread(next, it, None)
                if piece is None:
                    break
                if piece:
                    delta = {"delta": {"content": piece}} if chat else {"text": piece}
                    yield f"data: {json.dumps(chunk(rid, chat, [{'index': 0, **delta}]))}\n\n"
            await asyncio.to_thread(worker.join)
        n = len(result.get("ids", []))
        end = {"index": 0, "finish_reason": "length" if n == gen["max_new_tokens"] else "stop",
               **({"delta": {}} if chat else {"text": ""})}
        yield f"data: {json.dumps(chunk(rid, chat, [end]))}\n\n"
        if (body.get("stream_options") or {}).get("include_usage"):
            yield f"data: {json.dumps(chunk(rid, chat, [], usage(len(ids), n)))}\n\n"
        yield "data: [DONE]\n\n"

    def chunk(rid: str, chat: bool, choices: list, use: dict | None = None) -> dict:
        return {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion",
                "created": int(time.time()), "model": served_name, "choices": choices,
                "usage": use}

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await handle(await request.json(), chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await handle(await request.json(), chat=True)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": served_name, "object": "model"}]}

    @app.get("/health")
    async def health():
        return {}

    return app


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--served-model-name", default=None)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8001)
    args = ap.parse_args()
    tok, lm = load(args.model)
    uvicorn.run(build_app(tok, lm, args.served_model_name or args.model), host=args.host,
                port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
