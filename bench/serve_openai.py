"""The official `openai` client against `groundtune serve`: N chat requests, streamed and not, at
concurrency C; errors counted, and each streamed answer's text compared with the plain one's.

    python bench/serve_openai.py --out bench/results/serve_openai.json     # tiny model, CPU: 512 each
    python bench/serve_openai.py --model random:qwen2.5-vl-3b --device cuda --requests 512 --concurrency 128 \
        --batch-size 64 --max-new-tokens 32

Each request asks one of 32 synthetic scenes (PNG as a data: URI) for its phrase, as a chat front-end
would: ``client.chat.completions.create(model=..., messages=[...])``, then the same with
``stream=True, stream_options={"include_usage": True}``: the chunks' text joined must be the plain
answer's text on the CPU (fp32; in bf16 on a GPU a batch can tip a near-tie, so there such answers
are counted apart), the last chunk with choices must carry the boxes (``groundtune``) and a usage
chunk must close the stream. Zero errors is the target (the script exits 1 otherwise).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import json
import time

from provenance import stamped
from serving import launch

from groundtune.data import synth
from groundtune.data.records import atomic_write


def scenes(n: int = 32) -> list[tuple[str, str]]:
    """(data: URI, phrase) of n synthetic scenes."""
    out = []
    for i in range(n):
        image, record = synth.make_sample(7, i)
        buffer = io.BytesIO()
        image.save(buffer, format="PNG")
        out.append(("data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode(), record["phrase"]))
    return out


def _messages(uri: str, phrase: str) -> list[dict]:
    return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": uri}},
                                         {"type": "text", "text": phrase}]}]


async def ask(client, model: str, uri: str, phrase: str, stream: bool) -> tuple[str, dict | None]:
    """The answer's text and its boxes, plain or streamed (a streamed answer's structure checked)."""
    if not stream:
        answer = await client.chat.completions.create(model=model, messages=_messages(uri, phrase))
        return answer.choices[0].message.content, getattr(answer, "groundtune", None) or answer.model_extra.get(
            "groundtune")
    text, boxes, usage = [], None, None
    chunks = await client.chat.completions.create(model=model, messages=_messages(uri, phrase), stream=True,
                                                  stream_options={"include_usage": True})
    async for chunk in chunks:
        if chunk.choices:
            text.append(chunk.choices[0].delta.content or "")
            boxes = (chunk.model_extra or {}).get("groundtune", boxes)
        elif chunk.usage is not None:
            usage = chunk.usage
    if usage is None or boxes is None:
        raise ValueError(f"a stream without {'usage' if usage is None else 'boxes'}")
    return "".join(text), boxes


async def run(url: str, n: int, concurrency: int, stream: bool, plain: dict | None) -> tuple[dict, dict]:
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=url + "/v1", api_key="unused", timeout=600, max_retries=0)
    model = (await client.models.list()).data[0].id
    items, answers, errors, differs = scenes(), {}, {}, 0
    queue = iter(range(n))

    async def worker() -> None:
        nonlocal differs
        for i in queue:
            uri, phrase = items[i % len(items)]
            try:
                text, _ = await ask(client, model, uri, phrase, stream)
                # counted apart from errors: in bf16 on a GPU a greedy answer can change with the batch it
                # was answered in (random weights leave near-ties), which no protocol fault explains
                differs += plain is not None and text != plain[i % len(items)]
                answers[i % len(items)] = text
            except Exception as e:  # noqa: BLE001 - every failure is counted by its kind
                errors[type(e).__name__] = errors.get(type(e).__name__, 0) + 1

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    seconds = time.perf_counter() - start
    await client.close()
    return ({"stream": stream, "requests": n, "concurrency": concurrency, "seconds": round(seconds, 2),
             "requests_per_s": round(n / seconds, 2), "errors": sum(errors.values()), "error_kinds": errors,
             "texts_differing_from_plain": differs if plain is not None else None},
            answers)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--requests", type=int, default=512)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--max-new-tokens", type=int, help="the server's answer length limit (default: its own)")
    parser.add_argument("--out", default="bench/results/serve_openai.json")
    args = parser.parse_args()
    limit = ["--max-new-tokens", str(args.max_new_tokens)] if args.max_new_tokens else []
    process, url = launch(args.model, "--device", args.device, "--batch-size", str(args.batch_size), *limit,
                          timeout_s=600)
    try:
        plain, answers = asyncio.run(run(url, args.requests, args.concurrency, False, None))
        streamed, _ = asyncio.run(run(url, args.requests, args.concurrency, True, answers))
    finally:
        process.terminate()
        process.wait(60)
    result = stamped({"model": args.model, "device": args.device, "batch_size": args.batch_size,
                      "max_new_tokens": args.max_new_tokens,
                      "runs": [plain, streamed]})
    with atomic_write(args.out) as f:
        f.write(json.dumps(result, indent=2) + "\n")
    for row in (plain, streamed):
        print(f"{'streamed' if row['stream'] else 'plain':>9}: {row['requests']} requests, {row['requests_per_s']} "
              f"req/s, {row['errors']} errors {row['error_kinds'] or ''}")
    print(f"wrote {args.out}")
    if plain["errors"] or streamed["errors"] or (args.device == "cpu" and streamed["texts_differing_from_plain"]):
        raise SystemExit(1)  # the target is none: a run with errors is a failed run (and in fp32, so is a change)


if __name__ == "__main__":
    main()
