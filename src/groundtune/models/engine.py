"""The generation engine behind ``infer``: encoded prompts -> answer token ids, with no padding in
the prefill and, on a GPU, one launch per decode step.

Plain transformers ``generate`` pads a batch to its longest prompt, runs the language model over
the padding, and issues every decode step from Python: per new token ~36 layers x ~15 kernels
launched one by one, ~30 ms a step for a 3B at batch 64 where reading its weights takes ~1.5 ms.
Here one batch goes:

1. prefill: the prompts packed in ONE row (``qwen.collate_packed``, the layout training uses),
   attended within each prompt by the variable-length kernel (models/attention.py), logits taken
   only at each prompt's last token. Each layer's keys and values go, as they are computed, into a
   static cache of (rows, kv_heads, columns, head_dim): prompt i right-aligned in row i, so every
   row writes its next token to the same column. A prompt given ``num_samples`` rows is prefilled
   once and copied into each (an RL group: G answers, one prefill).
2. decode: one step is the language model on one token per row against that cache, each row
   seeing only its own columns (a mask made inside the step from where its prompt starts). On a
   GPU the step is captured as a CUDA graph once per (rows, columns) and replayed: a token costs
   one launch instead of ~500. Elsewhere it runs as is, with the same tensors.
3. finished rows stay in the batch with their tokens replaced by padding (as ``generate`` does);
   the loop ends when every row has finished (checked every few steps: a check waits for the GPU).
   Where a row's next token depends on its own logits only (greedy: ``compact``), a check that
   finds at most half the rows still answering moves those rows' cache into a step of half the
   rows or fewer (their power of two on a GPU), so a batch does not run to its longest answer at
   its full width; sampled rows stay, so that their draws are ``generate``'s.

The model's own modules compute everything: the engine only attaches its cache to our language
model attention (``attention.attached``), which writes and reads it in place of transformers'
cache objects. Greedy answers equal plain ``generate``'s: tests/test_engine.py compares them in
fp32 for all three families and for LoRA adapters merged or not; bench/eval_speed.py on the 3B/7B.
"""

from __future__ import annotations

import contextlib
import warnings
from collections import OrderedDict

import torch
import torch.nn.functional as F

from groundtune.models import attention, qwen

COLUMN_STEP = 256  # cache lengths round up to this so batches of similar prompts share a graph (the 3B at
# batch 64 reads 256 more columns in ~0.1 ms a step, its weights in ~1.3)
# Captured (rows, columns) shapes are kept, each with its cache, least recently used dropped first,
# while their caches fit this many bytes (the 3B at 64 rows x 512 columns: ~1.2 GB; at 16: ~0.3)
CACHE_BYTES_KEPT = 2.5 * 2**30
CHECK_EVERY = 4  # decode steps between checks that every row has finished
GRAPHS_ENABLED = True  # bench/eval_speed.py switches the graphs off to measure what they give
ROWS_LEAVE = True  # finished greedy rows leave the batch (bench/eval_speed.py measures it off too)


class KVCache:
    """Keys and values of every language-model layer for ``rows`` rows of ``columns`` tokens, and
    where each row's prompt starts (``row_start``; its columns before that are never seen)."""

    def __init__(self, layers: int, rows: int, kv_heads: int, columns: int, head_dim: int, dtype, device):
        shape = (rows, kv_heads, columns, head_dim)
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)]
        self.row_start = torch.zeros(rows, dtype=torch.long, device=device)
        self.column = torch.zeros(1, dtype=torch.long, device=device)  # where the decode step writes
        self.all_columns = torch.arange(columns, device=device)
        self.prompt_columns = 0  # prefill: prompts end at this column
        self.prompt_index: torch.Tensor | None = None  # prefill: packed-row position of each prompt column
        self.layout: attention.SharedPrefixes | None = None  # prefill: how the packed row attends
        self.mask: torch.Tensor | None = None  # decode: (rows, 1, 1, columns), made by each step

    def attend(self, layer: int, query, key, value, scale: float, cu_seqlens, max_length):
        """Our language-model attention while this cache is attached: the prefill (one packed row,
        ``cu_seqlens`` given) stores its keys/values and attends as its ``layout`` says; a decode step
        (one token per row) stores its token's and attends over the row's columns."""
        k_cache, v_cache = self.keys[layer], self.values[layer]
        rows, columns = k_cache.shape[0], self.prompt_columns
        if cu_seqlens is not None:
            for cache, new in ((k_cache, key), (v_cache, value)):
                # (1, kv_heads, tokens, dim) -> (kv_heads, rows * columns, dim) -> (rows, kv_heads, columns, dim)
                cache[:, :, :columns] = new[0][:, self.prompt_index].unflatten(1, (rows, columns)).transpose(0, 1)
            return self.layout.attend(layer, query, key, value, scale)
        k_cache.index_copy_(2, self.column, key)
        v_cache.index_copy_(2, self.column, value)
        # One query per row: the query heads that share a key/value head become that head's
        # "queries", so no key or value is repeated (transformers' repeat_kv would copy the whole
        # cache every layer and step) and every backend that takes a mask can run it.
        batch, heads, _, dim = query.shape
        grouped = query.reshape(batch, k_cache.shape[1], heads // k_cache.shape[1], dim)
        out = F.scaled_dot_product_attention(grouped, k_cache, v_cache, attn_mask=self.mask, scale=scale)
        return out.reshape(batch, heads, 1, dim).transpose(1, 2), None


class _Step:
    """The static inputs and outputs of one decode step for one (rows, columns) shape, with its
    cache, and (on a GPU) the step captured as a CUDA graph."""

    def __init__(self, engine: Engine, rows: int, columns: int):
        # what the step runs, not the engine itself: the engine holds its steps, and a cycle would
        # keep a dropped engine's caches and graphs on the GPU until the next garbage collection
        self.decoder, self.lm_head, self.pool = engine.decoder, engine.lm_head, engine.graph_pool
        self.cache = engine.new_cache(rows, columns)
        device = engine.device
        self.tokens = torch.zeros(rows, 1, dtype=torch.long, device=device)
        self.positions = torch.zeros(3, rows, 1, dtype=torch.long, device=device)
        self.logits = torch.zeros(rows, engine.vocab_size, dtype=torch.float32, device=device)
        self.graph = None

    def compute(self) -> None:
        cache = self.cache
        cache.mask = ((cache.all_columns >= cache.row_start[:, None])
                      & (cache.all_columns <= cache.column))[:, None, None, :]
        with attention.attached(cache):
            hidden = self.decoder(input_ids=self.tokens, position_ids=self.positions, use_cache=False).last_hidden_state
        self.logits.copy_(self.lm_head(hidden[:, -1]).float())

    def run(self) -> None:
        if self.pool is None:  # no graphs: the step as it is
            return self.compute()
        if self.graph is None:
            # Warm up on a side stream (lazy initialisations, kernel autotuning), then capture.
            # The warm-up writes this step's column, which the real step overwrites.
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(2):
                    self.compute()
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            try:
                # thread_local: the read-ahead thread (infer) and the loader's pin-memory thread
                # (an eval during training) allocate page-locked memory meanwhile; under the
                # default global mode such a call from any thread breaks this capture and fails there
                with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
                    self.compute()
            except RuntimeError as e:
                # a layer that waits on the host (a quantised kernel, a custom module) cannot be
                # captured: the step then runs as it is, slower and the same
                warnings.warn(f"generation: the decode step cannot be captured as a CUDA graph ({e}); "
                              "running it without", stacklevel=2)
                self.pool = None
                return self.compute()
            self.graph = graph
        self.graph.replay()


class Engine:
    """Generation for one model (a Qwen-VL model, or a PEFT model around one), in eval mode with
    our language-model attention installed (``usable``). Keeps the captured decode steps whose
    caches fit CACHE_BYTES_KEPT; ``release`` (or dropping the engine) frees them. With graphs, a
    batch's rows are rounded up to a power of two (copies of its last row fill the rest), so a
    server's batches of 1 to 16 share five captured shapes instead of sixteen."""

    def __init__(self, model, pad_token_id: int, stop_token_ids: list[int], use_graphs: bool | None = None):
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        self.model = model
        self.decoder = base.get_decoder()  # the language model
        self.lm_head = base.get_output_embeddings()
        text = base.config.get_text_config()
        self.layers = text.num_hidden_layers
        self.kv_heads = text.num_key_value_heads
        self.head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
        self.vocab_size = self.lm_head.out_features
        param = next(self.decoder.parameters())
        self.device, self.dtype = param.device, param.dtype
        self.pad_token_id = pad_token_id
        self.stop_token_ids = torch.tensor(sorted(set(stop_token_ids) | {pad_token_id}), device=self.device)
        self.use_graphs = GRAPHS_ENABLED and self.device.type == "cuda" if use_graphs is None else use_graphs
        self.row_buckets = self.use_graphs  # rows rounded up to a power of two (the class docstring says why)
        self.graph_pool = torch.cuda.graph_pool_handle() if self.use_graphs else None
        self.steps: OrderedDict[tuple[int, int], _Step] = OrderedDict()

    @staticmethod
    def usable(model) -> bool:
        """Whether ``model`` attends with our language-model attention (speedups.install), which
        the engine's cache plugs into (transformers' own attention paths do not)."""
        return str(model.config.get_text_config()._attn_implementation) == attention.TEXT_ATTENTION

    def new_cache(self, rows: int, columns: int) -> KVCache:
        return KVCache(self.layers, rows, self.kv_heads, columns, self.head_dim, self.dtype, self.device)

    def release(self) -> None:
        self.steps.clear()

    def _step(self, rows: int, columns: int) -> _Step:
        key = (rows, columns)
        if key in self.steps:
            self.steps.move_to_end(key)
            return self.steps[key]
        cache_bytes = 2 * self.layers * rows * self.kv_heads * columns * self.head_dim * self.dtype.itemsize
        while self.steps and (len(self.steps) + 1) * cache_bytes > CACHE_BYTES_KEPT:
            self.steps.popitem(last=False)  # (shapes of one engine are of similar size)
        if not self.steps and self.use_graphs:
            # A pool whose graphs are all gone cannot take another capture (the caching allocator
            # asserts that a shared pool has a live user): the next graphs go into a fresh one.
            self.graph_pool = torch.cuda.graph_pool_handle()
        self.steps[key] = _Step(self, rows, columns)
        return self.steps[key]

    @torch.inference_mode()
    def generate(self, prompts: list[dict], max_new_tokens: int, choose, num_samples: int = 1,
                 row: qwen.SharedRow | None = None, compact: bool = False) -> list[list[int]]:
        """Answer encoded prompts (``qwen.encode`` without an answer): ``num_samples`` rows each,
        row after row of one prompt. ``choose`` turns (rows, vocab) float logits into the next
        token of each row (greedy or sampled: infer.Decoding). Returns each row's generated ids,
        ``max_new_tokens`` of them, padding after its first stop token. ``row``: the prompts
        already in one row (``qwen.collate_shared``), put there by a thread while the GPU answered
        the batch before (``infer.predict_records``). ``compact``: ``choose`` picks each row's
        token from that row's logits alone (greedy), so finished rows may leave the batch."""
        lengths = [len(p["input_ids"]) for p in prompts]
        prompt_columns = max(lengths)
        rows = len(prompts) * num_samples
        width = 1 << (rows - 1).bit_length() if self.row_buckets else rows  # rows computed, the copies included
        columns = -(-(prompt_columns + max_new_tokens) // COLUMN_STEP) * COLUMN_STEP
        step = self._step(width, columns)
        cache = step.cache

        def each_row(t: torch.Tensor) -> torch.Tensor:
            """Per prompt -> per row: each prompt's num_samples rows, then copies of the last row."""
            t = t.repeat_interleave(num_samples, dim=0)
            return torch.cat([t, t[-1:].expand(width - rows, *t.shape[1:])]) if width > rows else t

        # 1. prefill, one packed row, the phrases asked of one image sharing its tokens
        # (qwen.collate_shared); each row's prompt columns come from its prompt's tokens, right-aligned
        if row is None:
            row = qwen.collate_shared(prompts)
        # (pixels in page-locked memory are copied beside the host's work; the other tensors are small)
        packed = {k: v.to(self.device, non_blocking=True) if isinstance(v, torch.Tensor) else v
                  for k, v in row.inputs.items()}
        index = torch.zeros(len(prompts), prompt_columns, dtype=torch.long)  # before a prompt: masked anyway
        for i, tokens in enumerate(row.tokens):
            index[i, prompt_columns - len(tokens):] = torch.tensor(tokens)
        cache.prompt_index = each_row(index.to(self.device)).flatten()
        cache.prompt_columns = prompt_columns
        cache.layout = row.layout.to(self.device)
        cache.row_start.copy_(each_row(prompt_columns - torch.tensor(lengths, device=self.device)))
        last = torch.tensor(row.last, device=self.device)
        with attention.attached(cache):
            logits = self.model(**packed, logits_to_keep=last, use_cache=False).logits[0].float()
        cache.prompt_index = cache.layout = None
        # the next token's M-RoPE position: one past the prompt's last (a text token: equal on all axes)
        next_position = each_row(packed["position_ids"][0, 0, last]) + 1

        # 2. decode; each step's tokens go to the rows they answer (``origin``: which answer each
        # row of the step is; the copies that fill a bucket answer the last real row again)
        tokens = choose(each_row(logits))
        finished = torch.isin(tokens, self.stop_token_ids)
        answer = torch.full((width, max_new_tokens), self.pad_token_id, dtype=torch.long, device=self.device)
        answer[:, 0] = tokens
        origin = torch.arange(width, device=self.device)
        for i in range(1, max_new_tokens):
            if i % CHECK_EVERY == 0:
                answering = torch.nonzero(~finished[:rows]).flatten()
                if len(answering) == 0:
                    break
                if compact and ROWS_LEAVE and len(answering) <= len(finished) // 2:
                    step, rows, origin, tokens, finished, next_position = self._compacted(
                        step, answering, origin, tokens, finished, next_position)
                    cache = step.cache
            step.tokens.copy_(tokens[:, None])
            step.positions.copy_((next_position + i - 1)[None, :, None].expand(3, -1, -1))
            cache.column.fill_(prompt_columns + i - 1)
            step.run()
            tokens = choose(step.logits)
            tokens = torch.where(finished, self.pad_token_id, tokens)
            finished |= torch.isin(tokens, self.stop_token_ids)
            answer[origin[:rows], i] = tokens[:rows]
        return answer[:len(prompts) * num_samples].tolist()

    def _compacted(self, step: _Step, keep: torch.Tensor, origin, tokens, finished, next_position):
        """The rows ``keep`` of a decode in a step of their own width: their cache (keys, values,
        where each prompt starts) and per-row state copied there, the last kept row copied into the
        rows that fill a bucket. Returns the new step, its real rows and their state."""
        rows = len(keep)
        width = 1 << (rows - 1).bit_length() if self.row_buckets else rows
        source = torch.cat([keep, keep[-1:].expand(width - rows)])  # what each new row takes
        columns = step.cache.keys[0].shape[2]
        smaller = self._step(width, columns)
        for old, new in zip(step.cache.keys + step.cache.values, smaller.cache.keys + smaller.cache.values):
            torch.index_select(old, 0, source, out=new)
        smaller.cache.row_start.copy_(step.cache.row_start[source])
        return (smaller, rows, origin[source], tokens[source], finished[source], next_position[source])


@contextlib.contextmanager
def evaluating(model):
    """``model`` in eval mode, given back in the mode it was in (training calls eval mid-run)."""
    was_training = model.training
    model.eval()
    try:
        yield model
    finally:
        model.train(was_training)
