"""Structured output: a grammar (JSON object, JSON schema, regex, choice, EBNF) constrains which tokens a
request may sample, through xgrammar.

The split between host and device:
  host    one xgrammar GrammarMatcher per constrained request. After each of its tokens is known the matcher
          advances (accept_token); before its next sampling step it writes the request's allowed-token bitmask
          (int32 words, bit v % 32 of word v // 32) into a pinned host row, copied to the device row.
  device  masks [S+1, W] int32, one row per state row of PenaltyState (a constrained request always holds one;
          the neutral row S allows every token). apply(scores, rows) unpacks the rows' words into a bool
          [R, V] mask and sets disallowed tokens to -inf: a fixed sequence of tensor ops on `rows`, so the
          decode graphs' processed variant runs it with `rows` in the staged buffer.
Because the next mask depends on the token just sampled, a constrained request cannot be overlapped (its token
must be on the host before the next step is staged); it still replays the processed decode graph.

Shape legend: S max_num_seqs (state rows), V vocab, W = ceil(V / 32) bitmask words, R rows sampled this step.
"""

from __future__ import annotations

import json
import threading

import xgrammar

from m3serve.engine.structured_params import StructuredOutputsParams, choice_grammar
from m3serve.engine.token_masks import TokenMaskRows

class GrammarCompiler:
    """Compiles StructuredOutputsParams for one tokenizer and vocabulary (thread-safe, cached: the server may
    compile on its own threads, the engine then finds the result in the cache)."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids):
        if tokenizer is None:
            raise ValueError("structured output needs the model's tokenizer; this model has none")
        self.vocab_size = vocab_size
        info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                       stop_token_ids=sorted(stop_token_ids))
        self._compiler = xgrammar.GrammarCompiler(info, max_threads=1)
        self._cache: dict[tuple, xgrammar.CompiledGrammar] = {}
        self._lock = threading.Lock()

    def compile(self, p: StructuredOutputsParams) -> xgrammar.CompiledGrammar:
        key = p.cache_key()
        with self._lock:
            hit = self._cache.get(key)
        if hit is not None:
            return hit
        kind, c = p.kind, self._compiler
        field_name = f"SamplingParams.structured_outputs.{kind}"
        try:
            if kind == "json":
                text = p.json if isinstance(p.json, str) else json.dumps(p.json)
                g = c.compile_json_schema(text, any_whitespace=p.whitespace_flexible)
            elif kind == "json_object":
                g = c.compile_json_schema('{"type": "object"}', any_whitespace=p.whitespace_flexible)
            elif kind == "regex":
                g = c.compile_regex(p.regex)
            elif kind == "choice":
                g = c.compile_grammar(choice_grammar(p.choice))
            else:
                g = c.compile_grammar(p.grammar)
        except Exception as e:      # xgrammar raises RuntimeError / ValueError subclasses with its parser message
            raise ValueError(f"{field_name}: cannot be compiled: {str(e).strip()[:300]}") from None
        with self._lock:
            if len(self._cache) > 256:
                self._cache.clear()
            self._cache[key] = g
        return g


class Grammars:
    """One xgrammar matcher per constrained request (host); it writes the request's next-token mask into its
    TokenMaskRows row before each sampling step and advances past each sampled token."""

    def __init__(self, compiler: GrammarCompiler, rows: TokenMaskRows):
        if rows.vocab != compiler.vocab_size:
            raise ValueError(f"Grammars: mask rows cover {rows.vocab} tokens, the compiler {compiler.vocab_size}")
        self.compiler, self.rows = compiler, rows
        self._matchers: dict[int, xgrammar.GrammarMatcher] = {}
        self._dirty: set[int] = set()   # state rows holding a grammar mask
        self.masked_steps = 0        # sampling steps that applied at least one grammar mask
        self.graph_masked_steps = 0  # of them, inside a decode graph (the processed variant)

    def start(self, request_id: int, p: StructuredOutputsParams) -> None:
        self._matchers[request_id] = xgrammar.GrammarMatcher(self.compiler.compile(p))

    def has(self, request_id: int) -> bool:
        return request_id in self._matchers

    def __len__(self) -> int:
        return len(self._matchers)

    def release(self, request_id: int) -> None:
        self._matchers.pop(request_id, None)

    def advance(self, request_id: int, token: int) -> bool:
        """The request sampled `token` under its mask: move its matcher past it. False when the grammar refuses
        it (only possible when other logits processing forbade every token the grammar allows)."""
        m = self._matchers.get(request_id)
        return m is None or m.is_terminated() or m.accept_token(token)

    def complete(self, request_id: int) -> bool:
        """The request's grammar has ended (it accepted a stop token): nothing more may follow."""
        m = self._matchers.get(request_id)
        return m is not None and m.is_terminated()

    def fill(self, request_ids: list[int], state_rows: list[int], in_graph: bool) -> bool:
        """Write each constrained request's next-token mask into its state row, and reset a row a constrained
        request used before (it finished, or was preempted and lost the row) that now serves a request without
        a grammar. Returns whether any row is constrained this step (counted as a masked step)."""
        any_masked = False
        for rid, row in zip(request_ids, state_rows):
            m = self._matchers.get(rid)
            if m is None:
                if row in self._dirty:
                    self.rows.clear_row(row)
                    self._dirty.discard(row)
                continue
            m.fill_next_token_bitmask(self.rows.host, row)
            self.rows.write_row(row)
            self._dirty.add(row)
            any_masked = True
        if any_masked:
            self.masked_steps += 1
            self.graph_masked_steps += in_graph
        return any_masked


def reference_allowed(compiled: xgrammar.CompiledGrammar, prefix: list[int], vocab: int) -> list[int]:
    """Token ids a fresh matcher allows after `prefix`, read bit by bit (tests compare apply() with it)."""
    m = xgrammar.GrammarMatcher(compiled)
    for t in prefix:
        if not m.accept_token(t):
            raise ValueError(f"prefix token {t} is outside the grammar")
    bm = xgrammar.allocate_token_bitmask(1, vocab)
    m.fill_next_token_bitmask(bm, 0)
    words = bm[0].tolist()
    return [v for v in range(vocab) if (words[v // 32] >> (v % 32)) & 1]
