"""Training data (docs/algorithm.md, "Training data"): reading, chat rendering with a loss mask, packing,
the step's batch and where its anchors may fall.

Plain text (and --data-ids) is one stream cut into windows, every token supervised. Chat records are
templated, thinking off, the loss on the assistant's tokens, conversations packed whole into rows and
attending only within themselves: RoPE depends on distances only, so each computes what it does alone.
Step s's global batch depends only on (seed, s, G): resuming or the process count do not change it.
"""
from __future__ import annotations

import bisect
import hashlib
import os
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Optional

import torch

from support.cli import UserError
from support.files import file_problem, read_jsonl
from support.text import ROLES, check_text

TEXT_SUFFIXES = (".txt", ".py", ".md", ".rst")
JSON_SUFFIXES = (".jsonl", ".json")
MASK_TOKEN = "<|mask|>"
EOS_TOKEN = "<|endoftext|>"
# how scripts/regenerate.py's responses ended: the stop token, or cut at --max-new-tokens
FINISH_REASONS = ("stop", "length")
# private-use characters: where an assistant message lands in the rendered text
_SENTINEL = "\ue000{}\ue001"


# Reading

def chatml_note(tok) -> Optional[str]:
    """How conversations are rendered on a target without a chat template (render_messages' own Qwen3
    ChatML), which speculate.py and eval.py would not render as chat; None with a template."""
    if tok.chat_template is not None:
        return None
    return "rendered as Qwen3's ChatML, the target having no chat template"


def _is_message(m) -> bool:
    """{"role": system/user/assistant, "content": str}."""
    if not isinstance(m, dict):
        return False
    return m.get("role") in ROLES and isinstance(m.get("content"), str)


def turns_problem(key: str, msgs) -> str:
    """What is wrong with a record's "messages"/"conversations" (key), a list not of role/content turns:
    ShareGPT's {"from", "value"} spelling, the usual other one, is named."""
    shape = '{"role": system/user/assistant, "content": str}'
    sharegpt = ""
    if isinstance(msgs, list) and any(isinstance(m, dict) and "from" in m and "value" in m for m in msgs):
        sharegpt = ' (ShareGPT\'s {"from", "value"} turns are not read)'
    return f"{key!r} must be a list of {shape} turns{sharegpt}"


def _listed_messages(obj: dict, where: str) -> Optional[list[dict]]:
    """A "messages" (or "conversations") record's turns, checked; None for another record."""
    if "messages" in obj:
        key = "messages"
    elif "conversations" in obj:
        key = "conversations"
    else:
        return None
    msgs = obj[key]
    if not isinstance(msgs, list) or not all(_is_message(m) for m in msgs):
        raise UserError(f"{where}: {turns_problem(key, msgs)}")
    roles = [m["role"] for m in msgs if m["role"] != "system"]
    if not roles or roles[0] != "user" or "assistant" not in roles:
        raise UserError(
            f"{where}: a conversation starts with a user message and has an assistant message")
    return [{"role": m["role"], "content": m["content"]} for m in msgs]


def _chat_messages(obj, where: str) -> Optional[list[dict]]:
    """A chat record's conversation, checked; None for another record."""
    if not isinstance(obj, dict):
        return None
    if isinstance(obj.get("prompt"), str) and isinstance(obj.get("response"), str):
        user = {"role": "user", "content": obj["prompt"]}
        assistant = {"role": "assistant", "content": obj["response"]}
        out = [user, assistant]
    else:
        out = _listed_messages(obj, where)
    if out is None:
        return None
    regenerated = obj.get("regenerated", {})  # scripts/regenerate.py's record
    if not isinstance(regenerated, dict):
        raise UserError(f"{where}: 'regenerated' must be an object (scripts/regenerate.py's), "
                        f"got {repr(regenerated)[:80]}")
    if "finish_reasons" in regenerated:
        answers = [m for m in out if m["role"] == "assistant"]
        reasons = regenerated["finish_reasons"]
        if not (isinstance(reasons, list) and len(reasons) == len(answers)):
            raise UserError(f"{where}: 'regenerated.finish_reasons' must list one reason an assistant "
                            f"message ({len(answers)}), got {repr(reasons)[:80]}")
        for m, reason in zip(answers, reasons):
            if reason not in FINISH_REASONS:  # another tool's word for a cut would train an end of turn
                raise UserError(f"{where}: 'regenerated.finish_reasons' holds {repr(reason)[:80]}; each is "
                                '"stop" or "length" (cut at the budget)')
            m["cut"] = reason == "length"  # cut at regenerate.py's budget: the target never ended the turn
    return out


def _turns(obj) -> Optional[list[str]]:
    """A {"turns": [str, ...]} record's turns (at least one); None for another record."""
    if not isinstance(obj, dict):
        return None
    turns = obj.get("turns")
    if not isinstance(turns, list) or not turns:
        return None
    if not all(isinstance(t, str) for t in turns):
        return None
    return turns


# the forms a record takes, one of them a record ("prompt" comes with "response")
RECORD_FORMS = ("text", "turns", "messages", "conversations", "prompt")


# a --data record's shapes, as a malformed line's error names them
DATA_RECORDS = '{"text": str}, {"turns": [str]}, {"messages": [...]} or {"prompt": str, "response": str}'


def _read_jsonl_docs(path: str, texts: list, chats: list):
    for where, obj in read_jsonl(path, records=DATA_RECORDS):
        forms = []
        if isinstance(obj, dict):
            obj = {key: value for key, value in obj.items() if value is not None}  # a table's empty column
            forms = [key for key in RECORD_FORMS if key in obj]
            if "system" in obj:  # it would be trained without, in silence
                raise UserError(f"{where}: a record's 'system' is not read; give it as a system message "
                                f"in \"messages\"")
        if len(forms) > 1:  # one would be trained on, the other dropped
            raise UserError(f"{where}: a record is one document or conversation, "
                            f"and this one has {' and '.join(forms)}")
        msgs = _chat_messages(obj, where)
        turns = _turns(obj)
        if msgs is not None:
            for m in msgs:
                check_text(m["content"], where)
            chats.append((where, msgs))
        elif isinstance(obj, dict) and isinstance(obj.get("text"), str):
            check_text(obj["text"], where)
            texts.append(obj["text"])
        elif turns is not None:
            text = "\n\n".join(turns)
            check_text(text, where)
            texts.append(text)
        else:
            raise UserError(f"{where}: expected {DATA_RECORDS}")


def _files_under(path: str) -> list[str]:
    """The text files and .jsonl under a directory, sorted, recursive."""
    suffixes = TEXT_SUFFIXES + (".jsonl",)
    files = []
    for d, _, names in os.walk(path):
        for f in names:
            if not f.endswith(suffixes):
                continue
            name = os.path.join(d, f)
            problem = file_problem(name)  # a pipe would hang the read; a broken link fail it
            if problem:
                raise UserError(f"--data {path}: {name}: {problem}")
            files.append(name)
    if not files:
        raise UserError(f"--data {path}: no {'/'.join(suffixes)} files in the directory")
    return sorted(files)


def read_documents(path: str) -> tuple[list[str], list[tuple[str, list[dict]]]]:
    """(plain texts, chat conversations as (where, messages)) of --data: a file, or the text files and .jsonl
    under a directory (sorted, recursive; non-UTF-8 text skipped). check_train_args has found it there."""
    files = [path]
    if os.path.isdir(path):
        files = _files_under(path)
    texts = []
    chats = []
    skipped = []
    for f in files:
        if f.endswith(JSON_SUFFIXES):
            _read_jsonl_docs(f, texts, chats)
            continue
        try:
            with open(f, encoding="utf-8") as fh:
                texts.append(fh.read())
        except UnicodeDecodeError:
            skipped.append(f)
    if skipped:
        print(f"--data: skipped {len(skipped)} file(s) that are not UTF-8 (first: {skipped[0]})",
              file=sys.stderr)
    texts = [t for t in texts if t]
    if texts and chats:
        first_chat = chats[0][0]
        raise UserError(
            f"--data {path}: mixes chat records ({first_chat}) with plain text; train on one kind")
    if not texts and not chats:
        raise UserError(f"--data {path}: no text")
    return texts, chats


def read_texts(path: str) -> list[str]:
    texts, chats = read_documents(path)
    if chats:
        raise UserError(f"{chats[0][0]}: a chat record; this program trains on plain text")
    return texts


def _is_id_list(ids) -> bool:
    """A non-empty list of ints (bools are not token ids)."""
    if not isinstance(ids, list) or not ids:
        return False
    return all(isinstance(i, int) and not isinstance(i, bool) for i in ids)


def read_id_lists(path: str, vocab_size: int) -> list[list[int]]:
    problem = file_problem(path)
    if problem:
        raise UserError(f"--data-ids {path}: {problem}")
    out = []
    for where, obj in read_jsonl(path):
        ids = None
        if isinstance(obj, dict):
            ids = obj.get("prompt_ids")
        if not _is_id_list(ids):
            raise UserError(f"{where}: expected {{\"prompt_ids\": [int, ...]}}")
        bad = [i for i in ids if not 0 <= i < vocab_size]
        if bad:
            vocab = f"0..{vocab_size - 1}"
            raise UserError(f"{where}: token id {bad[0]} is outside the vocabulary ({vocab})")
        out.append(ids)
    if not out:
        raise UserError(f"--data-ids {path}: no sequences")
    return out


def pack_windows(docs: list[list[int]], seq_len: int, separator: Optional[int],
                 source: str) -> torch.Tensor:
    """The documents joined (separator between them), cut into [N, seq_len] windows; the tail dropped."""
    stream = []
    for d in docs:
        stream.extend(d)
        if separator is not None:
            stream.append(separator)
    n = len(stream) // seq_len
    if n == 0:
        raise UserError(
            f"{source}: {len(stream)} tokens, fewer than one sequence of --seq-len {seq_len}")
    kept = torch.tensor(stream[:n * seq_len], dtype=torch.long)
    return kept.view(n, seq_len)


def read_windows(args, tok, vocab_size: int, separator: Optional[int],
                 texts: Optional[list[str]] = None) -> torch.Tensor:
    """The windows of plain --data (its `texts`, already read) or of --data-ids."""
    if args.data is not None:
        encodings = tok.tok.encode_batch(texts, add_special_tokens=False)
        docs = [e.ids for e in encodings]
        return pack_windows(docs, args.seq_len, separator, f"--data {args.data}")
    id_lists = read_id_lists(args.data_ids, vocab_size)
    return pack_windows(id_lists, args.seq_len, None, f"--data-ids {args.data_ids}")


# Chat records: rendering and the loss mask

def chat_spans(tok, messages: list[dict],
               stop_texts: list[str]) -> Optional[tuple[str, list[tuple[int, int]]]]:
    """(rendered text, character spans of the assistant turns: content + the stop text after it, unless
    the turn was cut at its budget). The spans are found by rendering again with a sentinel for each
    assistant message (a user turn quoting it is not mistaken for it); None when the template changes an
    assistant's text."""
    cuts = [m.get("cut", False) for m in messages]
    messages = [{"role": m["role"], "content": m["content"]} for m in messages]  # what the template sees
    text = tok.render_messages(messages, add_generation_prompt=False, thinking=False)
    marked = []
    for i, m in enumerate(messages):
        if m["role"] == "assistant":
            m = dict(m, content=_SENTINEL.format(i))
        marked.append(m)
    mtext = tok.render_messages(marked, add_generation_prompt=False, thinking=False)
    # rebuild the text from the marked one, each sentinel replaced by its content, noting the spans
    parts = []
    spans = []
    pos = 0
    length = 0
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        sentinel = _SENTINEL.format(i)
        s = mtext.find(sentinel, pos)
        if s < 0:
            return None
        parts.append(mtext[pos:s])
        length += s - pos
        spans.append((length, length + len(m["content"]), cuts[i]))
        parts.append(m["content"])
        length += len(m["content"])
        pos = s + len(sentinel)
    parts.append(mtext[pos:])
    if "".join(parts) != text:
        return None
    out = []
    for s, e, cut in spans:
        stop = ""
        for st in stop_texts:
            if st and text.startswith(st, e) and not cut:  # a cut response's turn end is not the target's
                stop = st
                break
        out.append((s, e + len(stop)))
    return text, out


def token_mask(offsets: list[tuple[int, int]], spans: list[tuple[int, int]]) -> list[bool]:
    starts = [o[0] for o in offsets]
    mask = [False] * len(offsets)
    for s, e in spans:
        first = bisect.bisect_left(starts, s)
        end = bisect.bisect_left(starts, e)
        for t in range(first, end):
            mask[t] = True
    return mask


def encode_chats(tok, chats: list[tuple[str, list[dict]]], stop_texts: list[str],
                 seq_len: Optional[int] = None) -> tuple[list[tuple[list[int], list[bool]]], int, int]:
    """(token ids, loss mask) of every conversation, and how many were skipped for each reason: the
    template rewrote the response, or no anchor lies within the first `seq_len` tokens (what packing keeps)."""
    rendered = []
    for where, msgs in chats:
        try:
            rendered.append(chat_spans(tok, msgs, stop_texts))
        except UserError as e:  # a template that refuses the conversation (raise_exception): say which
            raise UserError(f"{where}: {e}") from None
    keep = [r for r in rendered if r is not None]
    rewritten = len(chats) - len(keep)
    encs = []
    if keep:
        encs = tok.tok.encode_batch([r[0] for r in keep], add_special_tokens=False)
    docs = []
    for (_, spans), enc in zip(keep, encs):
        mask = token_mask(enc.offsets, spans)
        kept = mask
        if seq_len is not None:
            kept = mask[:seq_len]
        # some anchor with its successor in the response
        has_anchor = any(a and b for a, b in zip(kept, kept[1:]))
        if has_anchor:
            docs.append((enc.ids, mask))
    short = len(keep) - len(docs)
    return docs, rewritten, short


# Packing and the corpus

@dataclass
class Corpus:
    """Training rows [N, T]: tokens; loss_mask (None: all); doc, each token's document in its row, -1 for
    padding (None: one stream)."""
    tokens: torch.Tensor
    loss_mask: Optional[torch.Tensor] = None
    doc: Optional[torch.Tensor] = None

    def __len__(self) -> int:
        return len(self.tokens)

    def rows(self, index: torch.Tensor
             ) -> tuple[torch.Tensor, Optional[torch.Tensor], Optional[torch.Tensor]]:
        tokens = self.tokens[index].long()
        loss_mask = None
        if self.loss_mask is not None:
            loss_mask = self.loss_mask[index]
        doc = None
        if self.doc is not None:
            doc = self.doc[index].long()
        return tokens, loss_mask, doc


def pack_documents(docs: list[tuple[list[int], list[bool]]], seq_len: int, pad_id: int,
                   pack: bool = True) -> tuple[Corpus, dict]:
    """Best-fit-decreasing packing (a document longer than a row cut to it): each goes to the open row with
    the least room that holds it; pack=False: one a row. Returns the corpus and counts."""
    lengths = [min(len(ids), seq_len) for ids, _ in docs]
    if not pack:  # every document opens a row of its own
        own_rows = [[i] for i in range(len(docs))]
        return _fill_rows(docs, lengths, own_rows, seq_len, pad_id)
    order = sorted(range(len(docs)), key=lambda i: (-lengths[i], i))
    rows: list[list[int]] = []
    room: dict[int, list[int]] = {}  # free room -> rows with exactly that much left
    rooms: list[int] = []  # the sorted keys of `room`
    for i in order:
        n = lengths[i]
        k = bisect.bisect_left(rooms, n)
        if k == len(rooms):
            r = len(rows)
            free = seq_len
            rows.append([])
        else:
            free = rooms[k]
            r = room[free].pop()
            if not room[free]:
                del room[free]
                rooms.pop(k)
        rows[r].append(i)
        left = free - n
        if left > 0:
            if left not in room:
                room[left] = []
                bisect.insort(rooms, left)
            room[left].append(r)
    return _fill_rows(docs, lengths, rows, seq_len, pad_id)


def _fill_rows(docs, lengths: list[int], rows: list[list[int]], seq_len: int,
               pad_id: int) -> tuple[Corpus, dict]:
    shape = (len(rows), seq_len)
    tokens = torch.full(shape, pad_id, dtype=torch.int32)
    mask = torch.zeros(shape, dtype=torch.bool)
    # document ids are < seq_len
    doc_dtype = torch.int32
    if seq_len < 2 ** 15:
        doc_dtype = torch.int16
    doc = torch.full(shape, -1, dtype=doc_dtype)
    for r, members in enumerate(rows):
        pos = 0
        for j, i in enumerate(members):
            n = lengths[i]
            ids, loss = docs[i]
            span = slice(pos, pos + n)
            tokens[r, span] = torch.tensor(ids[:n], dtype=torch.int32)
            mask[r, span] = torch.tensor(loss[:n])
            doc[r, span] = j
            pos += n
    cut = sum(len(ids) > seq_len for ids, _ in docs)
    fill = sum(lengths) / max(1, len(rows) * seq_len)
    stats = {"rows": len(rows), "documents": len(docs), "cut": cut, "fill": fill}
    return Corpus(tokens, mask, doc), stats


DIGEST_CHUNK = 64 << 20  # bytes one thread hashes at a time


def _sha256(chunk) -> bytes:
    return hashlib.sha256(chunk).digest()


def digest(corpus: Corpus) -> str:
    """sha256 of the rows as stored, over 64 MiB chunks hashed in parallel threads, then their digests."""
    chunks = []
    head = hashlib.sha256()
    fields = (("tokens", corpus.tokens), ("loss_mask", corpus.loss_mask), ("doc", corpus.doc))
    for name, t in fields:
        if t is None:
            continue
        header = f"{name} {list(t.shape)} {t.dtype}\n"
        head.update(header.encode())
        raw = memoryview(t.contiguous().view(torch.uint8).numpy()).cast("B")
        for i in range(0, len(raw), DIGEST_CHUNK):
            chunks.append(raw[i:i + DIGEST_CHUNK])
    threads = min(32, os.cpu_count() or 1)
    with ThreadPoolExecutor(threads) as pool:
        for d in pool.map(_sha256, chunks):
            head.update(d)
    return head.hexdigest()


def load_corpus(args, target_args, say) -> Corpus:
    """train.py's rows of --data or --data-ids; `say` prints a line (rank 0)."""
    from support.checkpoint import stop_token_ids
    from support.text import Tokenizer

    if args.data is None:
        return Corpus(read_windows(args, None, target_args.vocab_size, None))
    if not os.path.isfile(os.path.join(args.target, "tokenizer.json")):
        raise UserError(
            f"--data needs the target's tokenizer.json ({args.target}); or give --data-ids")
    tok = Tokenizer(args.target)
    stops = stop_token_ids(args.target, target_args)
    sep = tok.tok.token_to_id(EOS_TOKEN)
    if sep is None and stops:
        sep = stops[0]
    texts, chats = read_documents(args.data)
    if texts:
        if not args.pack:
            raise UserError(f"--no-pack: --data {args.data} is plain text, cut into windows; "
                            f"only chat records are packed")
        if args.progress:  # minutes, for a large corpus
            say(f"--data: tokenizing {len(texts):,} documents")
        return Corpus(read_windows(args, tok, target_args.vocab_size, sep, texts))
    if args.progress:
        say(f"--data: rendering and tokenizing {len(chats):,} conversations")
    stop_texts = [tok.decode([i]) for i in stops]
    docs, rewritten, short = encode_chats(tok, chats, stop_texts, args.seq_len)
    why_skipped = (f"{rewritten} whose response the chat template rewrites, "
                   f"{short} without two response tokens in their first --seq-len {args.seq_len}")
    if not docs:
        raise UserError(f"--data {args.data}: no conversation has a response to train on ({why_skipped})")
    pad_id = 0
    if sep is not None:
        pad_id = sep
    corpus, st = pack_documents(docs, args.seq_len, pad_id, pack=args.pack)
    how = "one a row:"
    if args.pack:
        how = "packed into"
    filled = f"{st['fill']:.0%} filled, {st['cut']} cut to --seq-len {args.seq_len}"
    budget_cut = sum(m.get("cut", False) for _, msgs in chats for m in msgs)
    if budget_cut:
        filled += f", {budget_cut} responses cut at regenerate.py's budget, their end of turn not trained"
    rendered = ""
    note = chatml_note(tok)
    if note is not None:
        rendered = f"; {note}"
    say(f"--data: {st['documents']} conversations {how} {st['rows']} "
        f"sequences ({filled}, {rewritten + short} skipped: {why_skipped}){rendered}")
    return corpus


def document_mask(doc: torch.Tensor) -> torch.Tensor:
    """[B, T, T] bool: t may attend s iff s <= t in the same document."""
    T = doc.shape[1]
    causal = torch.ones(T, T, dtype=torch.bool, device=doc.device).tril()
    same_doc = doc[:, :, None] == doc[:, None, :]
    return same_doc & causal


# The step's batch and anchors

def seed_for(tag: str, *xs: int) -> int:
    text = ":".join([tag, *map(str, xs)])
    hex_digest = hashlib.sha256(text.encode()).hexdigest()
    return int(hex_digest[:15], 16)


class Batches:
    def __init__(self, n: int, batch_size: int, seed: int):
        self.n = n
        self.G = batch_size
        self.seed = seed
        self._perms = {}

    def _perm(self, epoch: int) -> torch.Tensor:
        if epoch not in self._perms:
            g = torch.Generator().manual_seed(seed_for("epoch", self.seed, epoch))
            self._perms = {epoch: torch.randperm(self.n, generator=g)}  # keep one epoch
        return self._perms[epoch]

    def __call__(self, step: int) -> torch.Tensor:
        N = self.n
        rows = []
        # the step's G positions in the endless sequence of epochs, each epoch a permutation
        for k in range(step * self.G, (step + 1) * self.G):
            rows.append(self._perm(k // N)[k % N])
        return torch.stack(rows)


def micro_slices(batch_size: int, grad_accum: int, rank: int) -> list[slice]:
    """Rank r's micro-batch m: rows (r·A + m)·B .. +B of the global batch (1 x A=2 takes what 2 x A=1 do)."""
    B = batch_size
    A = grad_accum
    slices = []
    for m in range(A):
        first = (rank * A + m) * B
        slices.append(slice(first, first + B))
    return slices


def anchor_candidates(loss_mask: Optional[torch.Tensor],
                      doc: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """[B, T-1]: a may be an anchor iff a and a+1 are in the loss mask and one document (None: all)."""
    if loss_mask is None and doc is None:
        return None
    like = doc
    if loss_mask is not None:
        like = loss_mask
    ok = torch.ones_like(like[:, 1:], dtype=torch.bool)
    if loss_mask is not None:
        both_in_loss = loss_mask[:, :-1] & loss_mask[:, 1:]
        ok = ok & both_in_loss
    if doc is not None:
        same_doc = doc[:, :-1] == doc[:, 1:]
        ok = ok & same_doc
    return ok


def sample_anchors(batch: int, seq_len: int, n: int, generator: torch.Generator,
                   allowed: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(anchors, keep) [batch, n]: n sorted positions a row, without replacement, where `allowed`; a row
    with fewer fills its last blocks with dummies (anchor 0, keep False)."""
    keys = torch.rand(batch, seq_len - 1, generator=generator)
    if allowed is None:
        picked = keys.argsort(dim=1)[:, :n]
        anchors = picked.sort(dim=1).values
        return anchors, torch.ones(batch, n, dtype=torch.bool)
    keys = keys.masked_fill(~allowed, 2.0)  # keys are < 1: the allowed positions come first
    picked = keys.argsort(dim=1)[:, :n]
    available = allowed.sum(1, keepdim=True).clamp(max=n)
    keep = torch.arange(n)[None, :] < available
    # a disallowed pick sorts last, past every real anchor
    anchors = torch.where(allowed.gather(1, picked), picked, seq_len)
    anchors = anchors.sort(dim=1).values
    return torch.where(keep, anchors, 0), keep


def supervised(anchors: torch.Tensor, keep: torch.Tensor, K: int, seq_len: int,
               loss_mask: Optional[torch.Tensor], doc: Optional[torch.Tensor]) -> torch.Tensor:
    """[B, N, K]: slot j of a kept block is supervised iff labels a+1..a+j+1 are in the row, the loss mask
    and the anchor's document."""
    B, N = anchors.shape
    offsets = torch.arange(K, device=anchors.device)
    label = anchors[:, :, None] + 1 + offsets  # [B, N, K]
    ok = label < seq_len
    at = label.clamp(max=seq_len - 1).view(B, -1)
    if loss_mask is not None:
        in_loss = loss_mask.gather(1, at).view(B, N, K)
        ok = ok & in_loss
    if doc is not None:
        label_doc = doc.gather(1, at).view(B, N, K)
        anchor_doc = doc.gather(1, anchors)[:, :, None]
        ok = ok & (label_doc == anchor_doc)
    # a slot counts only if every slot before it does
    prefix_ok = ok.int().cumprod(-1).bool()
    return prefix_ok & keep[:, :, None]
