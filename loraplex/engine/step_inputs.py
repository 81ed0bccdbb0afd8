"""Every input that changes from step to step, in one preallocated, padded structure that the
eager path and the CUDA graphs both read.

A step's inputs are written once, from the plan and the runner's per-request records, into
host buffers (pinned on CUDA), then copied to the device in one copy per dtype. The model
reads the device buffers: eagerly sliced to the step's exact sizes, or under a CUDA graph
sliced to a padded batch size (the slices keep their addresses, so a captured graph reads each
step's values). Padding is inert: token ids 0, cache slot -1 (nothing stored), sequence length
0 (attention gives zeros), adapter slot 0, sampled tokens written to the spare row.

Adding a per-step input means three edits: declare it in FIELDS, fill it in `fill`, read it
where the model runs. Nothing else copies or packs it.

Token masks (structured outputs) live beside them in buffers of their own (`mask_rows`,
`bitmask`), written and copied by `fill_masks` once the step's samples' grammars know their
next tokens, which may be after the step's forward pass is queued (see ModelRunner.begin)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from loraplex.engine.input_batch import InputBatch
from loraplex.engine.plan import StepPlan
from loraplex.engine.prompt_logprobs import PromptSelection
from loraplex.engine.relay_groups import NO_RELAY, RelayRule, find_groups
from loraplex.model.context import FloraRows

PENDING = -1
"""A token id the host does not know yet (sampled by a step still in flight): the device reads
it from the runner's `row_tokens`."""

TOKENS, SEQS, QUERY_STARTS, SAMPLES, FLORA_ROWS = "tokens", "seqs", "query_starts", "samples", "flora_rows"
MEMBERS, GROUP_STARTS = "members", "group_starts"
FLORA_ROW_BUCKETS = (16, 64, 256, 1024)
"""The FLoRA rows a decode graph is captured with (a step's rows are padded to the next one):
few enough graphs to capture, at most 4x the rows (padding rows cost their share of the
products, see llama.FLORA_FUSED_MAX_ROWS). 1024 covers 64 requests of rank 16. A decode step
with more rows runs eagerly."""


def flora_bucket(num_rows: int) -> int | None:
    """The FLoRA rows of the decode graph that a step with `num_rows` rows runs (None: eager)."""
    return next((b for b in FLORA_ROW_BUCKETS if num_rows <= b), None)


@dataclass(frozen=True)
class Field:
    name: str
    dtype: torch.dtype
    axis: str
    """TOKENS (one value per scheduled token), SEQS (per scheduled sequence), QUERY_STARTS (per
    sequence, plus one), SAMPLES (per token that samples), FLORA_ROWS (per FLoRA row of a
    decode step), MEMBERS (per relay group member, as many places as sequences), GROUP_STARTS
    (per relay group, plus one: sequences // 2 + 1)."""
    pad: float | str
    """Value of padding entries ("spare row": the spare row of row_tokens)."""


FIELDS = (
    Field("input_ids", torch.int64, TOKENS, 0),  # PENDING where the token is still on the device
    Field("positions", torch.int64, TOKENS, 0),
    Field("slot_mapping", torch.int64, TOKENS, -1),  # cache slot of each token; -1: not stored
    Field("token_rows", torch.int64, TOKENS, "spare row"),  # InputBatch row of each token
    Field("token_slots", torch.int32, TOKENS, 0),  # adapter slot of each token; 0: none
    Field("seq_lens", torch.int32, SEQS, 0),  # tokens of each sequence, the new ones included
    Field("query_start_loc", torch.int32, QUERY_STARTS, 0),  # padding: one token per sequence
    Field("logits_indices", torch.int64, SAMPLES, 0),  # the token (row of hidden) that samples
    Field("sample_rows", torch.int64, SAMPLES, "spare row"),  # where its token goes in row_tokens
    Field("temperature", torch.float32, SAMPLES, 0.0),
    Field("top_k", torch.int32, SAMPLES, 0),
    Field("top_p", torch.float32, SAMPLES, 1.0),
    Field("seeds", torch.int64, SAMPLES, 0),
    Field("offsets", torch.int64, SAMPLES, 0),  # index of the output token sampled next
    Field("prefix_lens", torch.int32, SEQS, 0),  # tokens of its relay group's prefix; 0: none
    Field("relay_members", torch.int32, MEMBERS, 0),  # sequences, relay group by group
    Field("group_starts", torch.int32, GROUP_STARTS, "members"),  # padding: empty groups at the end
    # A decode step's FLoRA rows (FloraRows), padded to its graph's count: written by `fill`.
    # Padding rows: token 0, slot 0 (whose FLoRA ranks are 0), component 0: they read nothing.
    Field("flora_row_tokens", torch.int64, FLORA_ROWS, 0),
    Field("flora_row_slots", torch.int32, FLORA_ROWS, 0),
    Field("flora_row_ranks", torch.int64, FLORA_ROWS, 0),
    Field("flora_bounds", torch.int64, QUERY_STARTS, 0),  # decode: a token a sequence
)


@dataclass(frozen=True)
class StepShape:
    """What the model runs: sizes (padded under a graph) and the switches a graph is keyed by."""

    num_tokens: int
    num_seqs: int
    num_samples: int
    max_query_len: int
    has_lora: bool
    is_greedy: bool
    is_padded_decode: bool
    """A decode step laid out for a graph: every sequence samples, padding included."""
    has_input_scale: bool = False
    """Some token's adapter scales o's input (IA3): one more launch on o."""
    has_expand: bool = True
    """Some token's adapter needs the LoRA shrink and expand (see LoraMetadata.has_expand)."""
    flora_rows: int = 0
    """FLoRA rows the step adds to each base product (`StepInputs.flora`; a decode step's
    padded to a FLORA_ROW_BUCKETS count); 0: no FLoRA token."""
    has_relay: bool = False
    """A decode step with relay groups (prefix_lens, relay_members, group_starts)."""
    is_padded_mixed: bool = False
    """A step that computes prompt tokens laid out for a graph (`StepInputs.fill`'s pad_mixed):
    num_tokens and num_seqs padded, every sequence a sample row (padding ones sample nothing
    that is kept)."""

    @property
    def has_flora(self) -> bool:
        return self.flora_rows > 0

    @property
    def is_padded(self) -> bool:
        """Laid out for a graph (a decode or a mixed step)."""
        return self.is_padded_decode or self.is_padded_mixed

    @property
    def graph_key(self) -> tuple[int, bool, bool, bool, bool, int, bool, int]:
        return (self.num_seqs, self.has_lora, self.is_greedy, self.has_input_scale, self.has_expand,
                self.flora_rows, self.has_relay, self.num_tokens if self.is_padded_mixed else 0)

    @property
    def num_group_starts(self) -> int:
        """Entries of group_starts the step reads (room for every possible group)."""
        return self.num_seqs // 2 + 1


@dataclass
class FilledStep:
    """The host side of a filled step: its shape, and what the runner needs to finish it."""

    shape: StepShape
    rows: np.ndarray  # [num_seqs] InputBatch rows of the scheduled requests, in plan order
    samples: np.ndarray  # [num_seqs] bool: which of them sample
    num_real_seqs: int
    start: np.ndarray  # [num_seqs] int64: each one's first position computed
    num_new: np.ndarray  # [num_seqs] int64: positions computed
    query_start: np.ndarray  # [num_seqs + 1] int64: offsets of each one's tokens in the step
    prompt: PromptSelection | None = None
    """Prompt positions whose log-probabilities the step computes (such a step runs eagerly)."""


@dataclass(frozen=True)
class SlotFamilies:
    """What the adapter in each slot needs of a step (host arrays [num_slots + 1], updated in
    place as slots are filled)."""

    flora_rank: np.ndarray
    """int64: the FLoRA adapter's rank (0: not FLoRA)."""
    input_scaled: np.ndarray
    """bool: the adapter scales o's input (IA3)."""
    needs_expand: np.ndarray
    """bool: the adapter needs the LoRA shrink and expand."""


def flora_row_arrays(token_slots: np.ndarray, ranks: np.ndarray, num_tokens: int
                     ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """FloraRows' arrays (row_tokens, row_slots, row_ranks, bounds) of tokens in slots
    `token_slots` with FLoRA ranks `ranks` [num_real_tokens], in a step of `num_tokens` tokens
    (padding included): each FLoRA token's rank components in turn."""
    num_rows = int(ranks.sum())
    row_tokens = np.repeat(np.arange(len(ranks)), ranks)
    row_slots = token_slots[row_tokens].astype(np.int32)
    row_ranks = np.arange(num_rows) - np.repeat(np.cumsum(ranks) - ranks, ranks)
    bounds = np.full(num_tokens + 1, num_rows, dtype=np.int64)
    bounds[0] = 0
    np.cumsum(ranks, out=bounds[1:len(ranks) + 1])
    return row_tokens, row_slots, row_ranks, bounds


class StepInputs:
    def __init__(self, max_tokens: int, max_seqs: int, max_seq_tokens: int, block_size: int,
                 device: torch.device, families: SlotFamilies | None = None,
                 relay: RelayRule | None = None, vocab_size: int = 0) -> None:
        """Room for `max_tokens` tokens and `max_seqs` sequences; the spare row of row_tokens
        (padding's destination) is `max_seqs`. `relay`: when decode steps form relay groups
        (None: never). `vocab_size`: the width of the token masks' bitmask rows (0: none)."""
        self.max_tokens, self.max_seqs, self.block_size = max_tokens, max_seqs, block_size
        self.max_seq_tokens = max_seq_tokens
        """The most tokens one sequence holds (the context: the rotary tables' length)."""
        self.max_blocks_per_seq = max_blocks_per_seq = -(-max_seq_tokens // block_size)
        self.device, self.families = device, families
        self.relay = relay if relay is not None else NO_RELAY
        self.num_relay_steps = self.num_relay_groups = self.num_relay_members = 0
        """Decode steps filled with relay groups, and their groups and members, in all."""
        self.flora: FloraRows | None = None
        """The FLoRA rows of the step filled last: views of the flora_* buffers for a decode step
        (padded; fixed addresses for the graphs), tensors of their own for other steps."""
        lengths = {TOKENS: max_tokens, SEQS: max_seqs, QUERY_STARTS: max_seqs + 1, SAMPLES: max_seqs,
                   FLORA_ROWS: FLORA_ROW_BUCKETS[-1], MEMBERS: max_seqs,
                   GROUP_STARTS: max_seqs // 2 + 1}
        pin = device.type == "cuda"
        # One buffer per dtype on each side; each field is a slice of its dtype's buffer.
        sizes: dict[torch.dtype, int] = {}
        spans: dict[str, tuple[torch.dtype, int, int]] = {}
        for f in FIELDS:
            start = sizes.get(f.dtype, 0)
            spans[f.name] = (f.dtype, start, start + lengths[f.axis])
            sizes[f.dtype] = start + lengths[f.axis]
        # Two host sets, used in turn: with steps overlapped, the host fills step N+1's while
        # the device may not yet have copied step N's. `_copied[i]` marks when it has read set i.
        # On CPU the device is the host and steps do not overlap: one set, read in place.
        self._on_host = device.type == "cpu"
        num_sets = 1 if self._on_host else 2
        host_sets = [{dtype: _zeros(n, dtype, "cpu", pin) for dtype, n in sizes.items()}
                     for _ in range(num_sets)]
        host_blocks = [_zeros((max_seqs, max_blocks_per_seq), torch.int32, "cpu", pin)
                       for _ in range(num_sets)]
        self._host_sets = [host_sets[i % num_sets] for i in range(2)]
        self._host_blocks = [host_blocks[i % num_sets] for i in range(2)]
        self._copied: list[torch.cuda.Event | None] = [None, None]
        self._turn = 0
        # Token masks: for each sample, the row of `bitmask` that masks its logits, or -1
        # (unmasked); bitmask rows [max_seqs, ceil(vocab / 32)] int32, bit set = token allowed.
        num_words = -(-vocab_size // 32)
        host_mask_rows = [_zeros(max_seqs, torch.int64, "cpu", pin).fill_(-1) for _ in range(num_sets)]
        host_bitmasks = [_zeros((max_seqs, num_words), torch.int32, "cpu", pin) for _ in range(num_sets)]
        self._host_mask_rows = [host_mask_rows[i % num_sets] for i in range(2)]
        self._host_bitmasks = [host_bitmasks[i % num_sets] for i in range(2)]
        if self._on_host:
            self._device, self.block_tables = host_sets[0], host_blocks[0]
            self.mask_rows, self.bitmask = host_mask_rows[0], host_bitmasks[0]
        else:
            self._device = {dtype: _zeros(n, dtype, device, False) for dtype, n in sizes.items()}
            self.block_tables = _zeros((max_seqs, max_blocks_per_seq), torch.int32, device, False)
            self.mask_rows = _zeros(max_seqs, torch.int64, device, False).fill_(-1)
            self.bitmask = _zeros((max_seqs, num_words), torch.int32, device, False)
        self._views = [{name: host[dtype].numpy()[lo:hi] for name, (dtype, lo, hi) in spans.items()}
                       for host in self._host_sets]
        self._pads = {f.name: max_seqs if f.pad == "spare row" else f.pad for f in FIELDS}
        self._axes = {f.name: f.axis for f in FIELDS}
        self._num_block_rows = 0
        for f in FIELDS:  # the device-side tensors the model reads, by name
            dtype, lo, hi = spans[f.name]
            setattr(self, f.name, self._device[dtype][lo:hi])

    # Filling ------------------------------------------------------------------------------
    def fill(self, plan: StepPlan, batch: InputBatch, pad_to: int | None,
             pad_mixed: tuple[int, int] | None = None) -> FilledStep:
        """Write the plan's inputs into the host buffers. `pad_to`: lay a decode step out for
        a graph of that many sequences (every sequence samples; padding after the real ones).
        `pad_mixed` (num_tokens, num_seqs): lay any other step out for a graph of that many
        tokens and sequences (at least its own, and tokens for one a padding sequence): each
        padding sequence owns one padding token and has length 0 (attention gives it zeros),
        the tokens past them belong to no sequence, and the sample rows are padded to the
        sequences (the real samples first)."""
        host = self._next_host_set()
        bs = self.block_size
        rows = np.fromiter((batch.row_of[r] for r in plan.request_ids), np.int64, len(plan.request_ids))
        num_new = np.asarray(plan.num_scheduled_tokens, dtype=np.int64)
        samples = np.asarray(plan.samples, dtype=bool)
        n = len(rows)
        query_start = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(num_new, out=query_start[1:])
        num_tokens = int(query_start[-1])
        start = batch.num_computed[rows]  # in the text; in the cache (attention sinks) less dropped:
        cached = start - batch.num_dropped[rows]
        max_query_len = int(num_new.max())
        if max_query_len == 1:
            token_rows, positions = rows, cached
            input_ids = [batch.tokens[r][p] for r, p in zip(rows.tolist(), start.tolist())]
        else:
            token_rows = np.repeat(rows, num_new)
            positions = np.repeat(cached - query_start[:-1], num_new) + np.arange(num_tokens)
            input_ids = [t for r, s, k in zip(rows.tolist(), start.tolist(), num_new.tolist())
                         for t in batch.tokens[r][s:s + k]]
        decode = pad_to is not None
        if decode:
            sample_of, sample_rows = np.arange(n), rows
        else:
            sample_of, sample_rows = np.flatnonzero(samples), rows[samples]
        token_slots = batch.adapter_slot[token_rows]
        blocks = batch.block_table[token_rows, positions // bs].astype(np.int64)
        tables = batch.block_table[rows]  # (a copy: read once, for the groups and the device)
        groups = find_groups(tables, cached + num_new, bs, self.relay if max_query_len == 1 else NO_RELAY)
        if groups.num_groups:
            self.num_relay_steps += 1
            self.num_relay_groups += groups.num_groups
            self.num_relay_members += len(groups.members)
        values = {
            "input_ids": input_ids, "positions": positions, "token_rows": token_rows,
            "slot_mapping": blocks * bs + positions % bs,
            "token_slots": token_slots, "seq_lens": cached + num_new, "query_start_loc": query_start,
            "logits_indices": query_start[1:][sample_of] - 1, "sample_rows": sample_rows,
            "temperature": batch.temperature[sample_rows], "top_k": batch.top_k[sample_rows],
            "top_p": batch.top_p[sample_rows], "seeds": batch.seed[sample_rows],
            "offsets": batch.num_tokens_of(sample_rows) - batch.num_prompt_tokens[sample_rows],
            "prefix_lens": groups.prefix_lens, "relay_members": groups.members,
            "group_starts": groups.group_starts,
        }
        size = pad_to if decode else n
        padded_tokens = size if decode else num_tokens
        if pad_mixed is not None and not decode:
            padded_tokens, size = pad_mixed
            if size < n or padded_tokens < num_tokens + size - n:
                raise ValueError(f"a step of {num_tokens} tokens over {n} sequences does not fit a "
                                 f"padded layout of {padded_tokens} tokens and {size} sequences")
        counts = {TOKENS: (num_tokens, padded_tokens), SEQS: (n, size),
                  QUERY_STARTS: (n + 1, size + 1),
                  SAMPLES: (len(sample_rows), size if decode or pad_mixed is not None else len(sample_rows)),
                  MEMBERS: (len(groups.members), size),
                  GROUP_STARTS: (groups.num_groups + 1, size // 2 + 1)}
        for name, value in values.items():
            used, padded = counts[self._axes[name]]
            out = host[name]
            out[:used] = value
            if name == "query_start_loc":  # padding sequences own one (padding) token each
                out[used:padded] = num_tokens + np.arange(1, padded - used + 1)
            elif name == "group_starts":
                out[used:padded] = len(groups.members)
            else:
                out[used:padded] = self._pads[name]
        self._host_blocks[self._turn].numpy()[:n] = tables
        self._num_block_rows = size
        has_lora = bool(token_slots.any())
        has_input_scale, has_expand, flora_rows, self.flora = False, has_lora, 0, None
        if has_lora and self.families is not None:
            has_input_scale = bool(self.families.input_scaled[token_slots].any())
            has_expand = has_input_scale or bool(self.families.needs_expand[token_slots].any())
            ranks = self.families.flora_rank[token_slots]
            if ranks.any():
                flora_rows = self._fill_flora(host, token_slots, ranks, padded_tokens,
                                              decode)
                # a decode step of FLoRA with the expand replays the graph that scales inputs too
                # (DecodeGraphs.variants); scaling by 1 where no adapter has IA3's vectors
                has_input_scale = has_input_scale or (decode and has_expand)
        mixed = pad_mixed is not None and not decode
        shape = StepShape(
            num_tokens=padded_tokens, num_seqs=size,
            num_samples=size if decode or mixed else len(sample_rows), max_query_len=max_query_len,
            has_lora=has_lora, is_greedy=not batch.temperature[sample_rows].any(),
            is_padded_decode=decode, has_input_scale=has_input_scale, has_expand=has_expand,
            flora_rows=flora_rows, has_relay=groups.num_groups > 0, is_padded_mixed=mixed)
        return FilledStep(shape, rows, samples, n, start, num_new, query_start)

    def _fill_flora(self, host: dict[str, np.ndarray], token_slots: np.ndarray, ranks: np.ndarray,
                    num_tokens: int, decode: bool) -> int:
        """Set `self.flora` to the FLoRA rows of tokens in slots `token_slots` with FLoRA ranks
        `ranks` [num_real_tokens] (each such token's rank components in turn) in a step of `num_tokens`
        tokens (padding included); returns the number of rows. A decode step's rows go into the
        flora_* buffers, padded to their graph's count; other steps' (and a decode step past the
        largest count: it runs eagerly) are tensors of their own."""
        row_tokens, row_slots, row_ranks, bounds = flora_row_arrays(token_slots, ranks, num_tokens)
        num_rows = len(row_tokens)
        bucket = flora_bucket(num_rows) if decode else None
        if bucket is None:
            arrays = (row_tokens, row_slots, row_ranks, bounds)
            self.flora = FloraRows(*(torch.from_numpy(a).to(self.device) for a in arrays))
            return num_rows
        host["flora_row_tokens"][:num_rows], host["flora_row_tokens"][num_rows:bucket] = row_tokens, 0
        host["flora_row_slots"][:num_rows], host["flora_row_slots"][num_rows:bucket] = row_slots, 0
        host["flora_row_ranks"][:num_rows], host["flora_row_ranks"][num_rows:bucket] = row_ranks, 0
        host["flora_bounds"][:num_tokens + 1] = bounds
        self.flora = FloraRows(self.flora_row_tokens[:bucket], self.flora_row_slots[:bucket],
                               self.flora_row_ranks[:bucket], self.flora_bounds[:num_tokens + 1])
        return bucket

    def upload(self) -> None:
        """Copy the filled host buffers to the device (queued on CUDA; nothing to do on CPU)."""
        if self._on_host:
            return
        host = self._host_sets[self._turn]
        for dtype, device_buffer in self._device.items():
            device_buffer.copy_(host[dtype], non_blocking=True)
        rows = self._num_block_rows
        self.block_tables[:rows].copy_(self._host_blocks[self._turn][:rows], non_blocking=True)
        if self.device.type == "cuda":
            self._copied[self._turn] = torch.cuda.Event()
            self._copied[self._turn].record()

    def fill_masks(self, num_samples: int, positions: list[int], bitmask: torch.Tensor) -> None:
        """Mask the step filled last: sample `positions[i]` (of its `num_samples`, padding
        included) draws only the tokens of `bitmask[i]` [len(positions), >= ceil(vocab / 32)]
        int32 (host); the others are not masked. Copied to the device at once (queued on CUDA)."""
        rows, bits = self._host_mask_rows[self._turn], self._host_bitmasks[self._turn]
        rows[:num_samples] = -1
        if positions:
            index = torch.tensor(positions, dtype=torch.int64)
            rows[index] = index
            bits[index] = bitmask[:, :bits.shape[1]]
        if self._on_host:
            return
        self.mask_rows[:num_samples].copy_(rows[:num_samples], non_blocking=True)
        self.bitmask[:num_samples].copy_(bits[:num_samples], non_blocking=True)
        if self.device.type == "cuda":  # the host set is free again once these copies are done
            self._copied[self._turn] = torch.cuda.Event()
            self._copied[self._turn].record()

    def dummy_shape(self, num_seqs: int, tokens_per_seq: int) -> tuple[int, int]:
        """(sequences, tokens each) of a dummy step of about `num_seqs` x `tokens_per_seq` tokens
        that fits: at most `max_seqs` sequences, none longer than the context (attention would read
        past its block-table row and the rotary tables; on a GPU, past the tensors: an illegal
        memory access; no real step holds such a sequence). A shape that fits is returned as it
        is; another keeps its total where the sequences allow."""
        num_tokens = num_seqs * tokens_per_seq
        num_seqs = min(self.max_seqs, max(num_seqs, -(-num_tokens // self.max_seq_tokens)))
        return num_seqs, min(num_tokens // num_seqs, self.max_seq_tokens)

    def fill_dummy(self, num_seqs: int, tokens_per_seq: int, adapter_slot: int, is_greedy: bool,
                   has_lora: bool, has_input_scale: bool = False, has_expand: bool = True,
                   flora_rows: int = 0, has_relay: bool = False) -> StepShape:
        """A step of dummy sequences that store nothing, to capture a graph (one token each:
        padding, attention reads nothing; with `has_relay`, empty relay groups) or to measure a
        step's memory (several tokens each: attention reads block 0 over and over). Every
        sequence samples. `flora_rows` (a decode step's, at most FLORA_ROW_BUCKETS[-1]): that many
        padding FLoRA rows."""
        if tokens_per_seq > self.max_seq_tokens or num_seqs > self.max_seqs:
            raise ValueError(f"a dummy step of {num_seqs} sequences of {tokens_per_seq} tokens does not "
                             f"fit {self.max_seqs} sequences of {self.max_seq_tokens} tokens "
                             "(see dummy_shape)")
        num_tokens = num_seqs * tokens_per_seq
        lens = np.full(num_seqs, tokens_per_seq, dtype=np.int64)
        host = self._write_dummy(lens, 0 if tokens_per_seq == 1 else lens, adapter_slot, is_greedy)
        if has_lora and flora_rows:
            if tokens_per_seq != 1 or flora_rows > FLORA_ROW_BUCKETS[-1]:
                raise ValueError("dummy FLoRA rows are for decode steps of at most "
                                 f"{FLORA_ROW_BUCKETS[-1]} rows")
            for name in ("flora_row_tokens", "flora_row_slots", "flora_row_ranks"):
                host[name][:flora_rows] = 0
            host["flora_bounds"][:num_tokens + 1] = 0
            self.flora = FloraRows(self.flora_row_tokens[:flora_rows], self.flora_row_slots[:flora_rows],
                                   self.flora_row_ranks[:flora_rows], self.flora_bounds[:num_tokens + 1])
        return StepShape(num_tokens, num_seqs, num_seqs, tokens_per_seq, has_lora=has_lora,
                         is_greedy=is_greedy, is_padded_decode=tokens_per_seq == 1,
                         has_input_scale=has_lora and has_input_scale,
                         has_expand=has_lora and (has_expand or has_input_scale),
                         flora_rows=flora_rows if has_lora else 0,
                         has_relay=has_relay and tokens_per_seq == 1 and num_seqs >= 2)

    def fill_dummy_mixed(self, num_tokens: int, num_seqs: int, is_greedy: bool, has_lora: bool) -> StepShape:
        """A padded mixed step of dummy sequences that store nothing, to capture its graph:
        `num_tokens` tokens spread evenly over `num_seqs` sequences whose lengths are their
        tokens (attention reads block 0 over and over), adapter slot 0 (the kernels read no
        adapter), every sequence sampling."""
        lens = np.full(num_seqs, num_tokens // num_seqs, dtype=np.int64)
        lens[:num_tokens % num_seqs] += 1
        if num_seqs > self.max_seqs or num_tokens > self.max_tokens or lens.max() > self.max_seq_tokens:
            raise ValueError(f"a dummy step of {num_tokens} tokens over {num_seqs} sequences does not fit "
                             f"{self.max_tokens} tokens, {self.max_seqs} sequences of {self.max_seq_tokens}")
        self._write_dummy(lens, lens, adapter_slot=0, is_greedy=is_greedy)
        return StepShape(num_tokens, num_seqs, num_seqs, int(lens.max()), has_lora=has_lora,
                         is_greedy=is_greedy, is_padded_decode=False, has_expand=has_lora,
                         is_padded_mixed=True)

    def _write_dummy(self, lens: np.ndarray, seq_lens: np.ndarray | int, adapter_slot: int,
                     is_greedy: bool) -> dict[str, np.ndarray]:
        """Write a dummy step of sequences of `lens` tokens (lengths `seq_lens`) that store
        nothing and all sample into the next host set, and return it."""
        host = self._next_host_set()
        num_tokens, num_seqs = int(lens.sum()), len(lens)
        ends = np.cumsum(lens)
        values = {
            "input_ids": 0, "positions": np.arange(num_tokens) - np.repeat(ends - lens, lens),
            "slot_mapping": -1, "token_rows": self.max_seqs, "token_slots": adapter_slot,
            "seq_lens": seq_lens,
            "query_start_loc": np.concatenate(([0], ends)), "logits_indices": ends - 1,
            "sample_rows": self.max_seqs, "temperature": 0.0 if is_greedy else 1.0, "top_k": 0,
            "top_p": 1.0, "seeds": 0, "offsets": 0, "prefix_lens": 0, "relay_members": 0,
            "group_starts": 0,
        }
        counts = {TOKENS: num_tokens, SEQS: num_seqs, QUERY_STARTS: num_seqs + 1, SAMPLES: num_seqs,
                  MEMBERS: num_seqs, GROUP_STARTS: num_seqs // 2 + 1}
        for name, value in values.items():
            host[name][:counts[self._axes[name]]] = value
        self._host_blocks[self._turn][:num_seqs] = 0
        self._num_block_rows = num_seqs
        self.flora = None
        return host

    def _next_host_set(self) -> dict[str, np.ndarray]:
        self._turn ^= 1
        if self._copied[self._turn] is not None:
            self._copied[self._turn].synchronize()  # long done in practice: two steps ago
        return self._views[self._turn]


def _zeros(shape: int | tuple[int, ...], dtype: torch.dtype, device: torch.device | str, pin: bool
           ) -> torch.Tensor:
    tensor = torch.zeros(shape, dtype=dtype, device=device)
    return tensor.pin_memory() if pin else tensor
