"""data.py and the chat path of train.py, each against a slow reference written here from the definition:
the loss mask over the assistant's tokens, the anchor rule, best-fit packing, per-document masking (a packed
row computes what each document computes alone), a short chat run, and the checkpoint's layout as the
authors' modeling code (DeepSpec's Qwen3DSparkModel) reads it.

Everything runs on conftest's tiny word-level target (vocab 64, a Qwen3-like ChatML template), in seconds.
"""

from __future__ import annotations

import json
import os
import random

import pytest
import torch
from conftest import CHAT_NO_THINK, IM_END_ID, IM_START_ID, build_tokenizer, render_chat
from test_train import run_train

import drafter as dr
import train
from support import checkpoint, configs, data, text
from support.cli import UserError

torch.set_num_threads(1)

CONVERSATION = [
    {"role": "system", "content": "the x is a"},
    {"role": "user", "content": "hello world"},
    {"role": "assistant", "content": "hello world"},  # the same words as the user's: the sentinel must tell them apart
    {"role": "user", "content": "print x"},
    {"role": "assistant", "content": "def x ( ) : return 1"},
]


def reference_chat(messages, vocab_size=64):
    """By definition, for conftest's template and word-level tokenizer: each message is <|im_start|>, its role,
    its words, <|im_end|> (whitespace, newlines included, is no token); the loss mask is an assistant's words
    and the <|im_end|> that ends its turn."""
    vocab = {w: i for i, w in enumerate(data_vocab(vocab_size))}
    ids, mask = [], []
    for m in messages:
        words = [vocab[w] for w in m["content"].split()]
        ids += [IM_START_ID, vocab[m["role"]], *words, IM_END_ID]
        a = m["role"] == "assistant"
        mask += [False, False] + [a] * len(words) + [a]
    return ids, mask


def data_vocab(vocab_size):
    from conftest import vocabulary
    return vocabulary(vocab_size)


def test_chat_loss_mask_is_the_assistant_tokens(tiny_target):
    tok = text.Tokenizer(str(tiny_target.path))
    docs, rewritten, short = data.encode_chats(tok, [("x:1", CONVERSATION)], ["<|im_end|>", "<|endoftext|>"])
    assert rewritten == short == 0 and len(docs) == 1
    ids, mask = docs[0]
    assert (ids, mask) == reference_chat(CONVERSATION)
    # prompt + response records are one user turn and one assistant turn
    rec = data._chat_messages({"prompt": "hello", "response": "world"}, "x:2")
    assert rec == [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "world"}]
    # A template that rewrites the assistant's text: the mask cannot be placed, the record is skipped.
    tok.chat_template = tok.chat_template.replace("message['content']", "message['content'] | upper")
    assert data.chat_spans(tok, CONVERSATION, ["<|im_end|>"]) is None
    assert data.encode_chats(tok, [("x:1", CONVERSATION)], ["<|im_end|>"]) == ([], 1, 0)
    # A template that refuses a conversation: the error names the record, not the template alone.
    tok.chat_template = "{{ raise_exception('System role not supported') }}"
    with pytest.raises(UserError, match=r"^x:7: .*cannot render the chat template .*System role not supported"):
        data.encode_chats(tok, [("x:7", CONVERSATION)], ["<|im_end|>"])


def test_a_response_cut_at_its_budget_trains_no_end_of_turn(tiny_target):
    """A regenerate.py record whose answer hit --max-new-tokens ("length"): the turn's <|im_end|> is the
    template's, not the target's, so it is left out of the loss mask (it was supervised, teaching an end
    of turn mid-sentence); a malformed finish_reasons is one line."""
    tok = text.Tokenizer(str(tiny_target.path))
    record = {"messages": CONVERSATION, "regenerated": {"finish_reasons": ["stop", "length"]}}
    cut = data._chat_messages(record, "x:1")
    (ids, mask), = data.encode_chats(tok, [("x:1", cut)], ["<|im_end|>"])[0]
    (_, whole), = data.encode_chats(tok, [("x:1", CONVERSATION)], ["<|im_end|>"])[0]
    ends = [i for i, t in enumerate(ids) if t == IM_END_ID]
    assert whole[ends[2]] and whole[ends[-1]] and mask[ends[2]] and not mask[ends[-1]]
    assert [m for i, m in enumerate(mask) if i != ends[-1]] == [m for i, m in enumerate(whole) if i != ends[-1]]
    seen = []  # the template sees role and content only, as for any other record
    render = tok.render_messages
    tok.render_messages = lambda msgs, **kw: (seen.extend(msgs), render(msgs, **kw))[1]
    data.chat_spans(tok, cut, ["<|im_end|>"])
    assert seen and all(set(m) == {"role", "content"} for m in seen)
    for reasons in (["stop"], "length"):
        with pytest.raises(UserError, match=r"^x:1: 'regenerated.finish_reasons' must list one reason an "):
            data._chat_messages({"messages": CONVERSATION, "regenerated": {"finish_reasons": reasons}}, "x:1")
    # a prompt and response record is read alike
    pair = {"prompt": "hello", "response": "world", "regenerated": {"finish_reasons": ["length"]}}
    assert data._chat_messages(pair, "x:2")[1]["cut"]
    with pytest.raises(UserError, match=r"^x:2: 'regenerated.finish_reasons' must list one reason an "):
        data._chat_messages(dict(pair, regenerated={"finish_reasons": ["stop", "stop"]}), "x:2")


def test_a_json_array_in_data_is_told_apart_from_json_lines(tmp_path):
    """A JSON array of records (a common dataset format) got the bare JSON error, or on one line "expected"
    the very records it holds; the line now says what each line holds."""
    p = tmp_path / "arr.json"
    p.write_text('[\n  {"text": "a"}\n]\n')
    with pytest.raises(UserError, match=r"arr.json:1: malformed JSON .*; each line is one whole JSON record, "
                                        r"one of \{\"text\": str\}"):
        data.read_documents(str(p))
    p.write_text(json.dumps([{"prompt": "a", "response": "hello world"}] * 3))  # on one line: it parses
    with pytest.raises(UserError, match=r"^[^\n]*arr.json:1: a JSON array, not a record: write one record per "
                                        r"line \(JSON lines\), each one of \{\"text\": str\}[^\n]*$"):
        data.read_documents(str(p))


def test_render_messages_without_template_is_qwen3_chatml(target_factory):
    tok = text.Tokenizer(str(target_factory(chat_template=False).path))
    one = [{"role": "user", "content": "hi"}]
    assert tok.render_messages(one, add_generation_prompt=True) == render_chat(tok, "hi") == \
        CHAT_NO_THINK.format(p="hi")
    rendered, spans = data.chat_spans(tok, CONVERSATION[1:3], ["<|im_end|>"])
    assert rendered == ("<|im_start|>user\nhello world<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
                        "hello world<|im_end|>\n")
    assert [rendered[s:e] for s, e in spans] == ["hello world<|im_end|>"]  # not the empty think block: the prompt's


@pytest.mark.parametrize("case,needle", [
    ({"messages": [{"role": "user", "content": "a"}]}, "has an assistant message"),
    ({"messages": [{"role": "assistant", "content": "a"}, {"role": "user", "content": "b"}]}, "starts with a user"),
    ({"messages": [{"role": "robot", "content": "a"}]}, "must be a list of"),
    ({"conversations": "hello"}, "must be a list of"),
    # ShareGPT's spelling of the turns: named, as scripts/regenerate.py names it
    ({"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}]},
     "'conversations' must be a list of {\"role\": system/user/assistant, \"content\": str} turns "
     "(ShareGPT's {\"from\", \"value\"} turns are not read)"),
    ({"something": 1}, "expected {\"text\": str}"),
    # a lone surrogate, which JSON can spell and the tokenizer refuses with a TypeError
    ({"messages": [{"role": "user", "content": "a \ud800"}, {"role": "assistant", "content": "b"}]},
     "not valid Unicode"),
    ({"prompt": "a", "response": "b \udfff"}, "not valid Unicode"),
    ({"text": "a \ud800 b"}, "not valid Unicode"),
    ({"turns": ["a", "\ud800"]}, "not valid Unicode"),
    # two forms in one record: one was trained on, the other dropped
    ({"prompt": "a", "response": "b", "messages": [{"role": "user", "content": "x"}]},
     "a record is one document or conversation, and this one has messages and prompt"),
    ({"text": "hello", "turns": ["other"]}, "this one has text and turns"),
    ({"text": 5, "turns": ["t"]}, "this one has text and turns"),
    ({"prompt": "p", "text": "q"}, "this one has text and prompt"),
    # a finish reason other than regenerate.py's two, or no object: a cut response was trained as ended
    *[({"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}],
        "regenerated": {"finish_reasons": [reason]}},
       f"d.jsonl:1: 'regenerated.finish_reasons' holds {reason!r}; each is \"stop\" or \"length\"")
      for reason in ("lenght", "max_tokens", "LENGTH", 7)],
    ({"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}], "regenerated": [1]},
     "d.jsonl:1: 'regenerated' must be an object (scripts/regenerate.py's), got [1]"),
])
def test_bad_chat_records_are_one_line_errors(tmp_path, case, needle):
    p = tmp_path / "d.jsonl"
    p.write_text(json.dumps(case) + "\n")
    with pytest.raises(UserError, match="d.jsonl:1") as e:
        data.read_documents(str(p))
    assert needle in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("make,needle", [
    (lambda p: os.mkfifo(p), "is a device or a pipe, not a file"),  # its read never returned
    (lambda p: os.symlink(p.parent / "gone.txt", p), "is a broken link"),  # an OSError traceback
])
def test_a_data_directorys_file_that_cannot_be_read_is_one_line(tmp_path, make, needle):
    d = tmp_path / "corpus"
    d.mkdir()
    (d / "a.txt").write_text("hello world\n")
    make(d / "b.txt")
    with pytest.raises(UserError, match=f"^--data {d}: {d / 'b.txt'}: .*{needle}"):
        data.read_documents(str(d))


def test_a_null_key_is_absent_as_in_the_prompts_readers(tmp_path):
    """A table's JSON-lines export writes every column, null where a row has none: --data reads a null
    key as absent, as speculate.py's --prompts-file and regenerate.py's --prompts do."""
    chat = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}
    rows = [dict(chat, prompt=None, response=None, text=None, conversations=None),
            {"text": "a document", "messages": None, "prompt": None}]
    p = tmp_path / "export.jsonl"
    p.write_text("".join(json.dumps(r) + "\n" for r in rows[:1]))
    assert data.read_documents(str(p)) == ([], [(f"{p}:1", chat["messages"])])
    p.write_text("".join(json.dumps(r) + "\n" for r in rows[1:]))
    assert data.read_documents(str(p)) == (["a document"], [])


def test_a_records_system_key_is_refused_not_dropped(tmp_path):
    """A "system" key beside prompt/response or messages is refused in one line: it was dropped, and the
    drafter trained on conversations without it."""
    p = tmp_path / "sys.jsonl"
    for record in ({"prompt": "hi", "response": "yo", "system": "be brief"},
                   {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}],
                    "system": "be brief"}):
        p.write_text(json.dumps(record) + "\n")
        with pytest.raises(UserError, match=r"sys.jsonl:1: a record's 'system' is not read; give it as a system"):
            data.read_documents(str(p))


def test_mixing_chat_and_text_is_an_error(tmp_path):
    (tmp_path / "a.jsonl").write_text(json.dumps({"text": "x"}) + "\n" + json.dumps({"prompt": "a", "response": "b"}) + "\n")
    with pytest.raises(UserError, match="mixes chat records"):
        data.read_documents(str(tmp_path / "a.jsonl"))


def test_data_that_holds_nothing_to_train_on_is_one_line(tmp_path, capsys):
    (tmp_path / "none").mkdir()
    with pytest.raises(UserError, match="none: no .txt/.py/.md/.rst/.jsonl files in the directory"):
        data.read_documents(str(tmp_path / "none"))
    (tmp_path / "blank").mkdir()
    (tmp_path / "blank" / "a.txt").write_text("")
    with pytest.raises(UserError, match="blank: no text"):
        data.read_documents(str(tmp_path / "blank"))
    # A file that is not UTF-8 is skipped with a line; the rest is read.
    (tmp_path / "mixed").mkdir()
    (tmp_path / "mixed" / "a.txt").write_bytes(b"\xff\xfe not utf-8")
    (tmp_path / "mixed" / "b.txt").write_text("hello")
    assert data.read_documents(str(tmp_path / "mixed")) == (["hello"], [])
    assert "skipped 1 file(s) that are not UTF-8" in capsys.readouterr().err
    # A program that pre-trains on plain text refuses chat records.
    (tmp_path / "chat.jsonl").write_text(json.dumps({"prompt": "a", "response": "b"}) + "\n")
    with pytest.raises(UserError, match="chat.jsonl:1: a chat record; this program trains on plain text"):
        data.read_texts(str(tmp_path / "chat.jsonl"))


@pytest.mark.parametrize("lines,needle", [
    ([{"prompt_ids": []}], 'ids.jsonl:1: expected {"prompt_ids": [int, ...]}'),
    ([{"prompt_ids": [1, True]}], 'ids.jsonl:1: expected {"prompt_ids": [int, ...]}'),
    ([], "ids.jsonl: no sequences"),
])
def test_bad_token_id_data_is_one_line(tmp_path, lines, needle):
    path = tmp_path / "ids.jsonl"
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    with pytest.raises(UserError) as e:
        data.read_id_lists(str(path), 64)
    assert needle in str(e.value)


def test_what_train_cannot_make_rows_of_is_refused(tiny_target, target_factory, tmp_path):
    ids = tmp_path / "ids.jsonl"
    ids.write_text(json.dumps({"prompt_ids": list(range(30))}) + "\n")
    small = ["--steps", 1, "--seq-len", 16, "--block-size", 2, "--depth", 1, "--markov-rank", 8]
    rc, _, err = run_train(["--target", tiny_target.path, "--data-ids", ids, "--out", tmp_path / "a", "--no-pack",
                            *small])
    assert rc == 2 and "--no-pack: changes nothing with --data-ids (windows of a token stream" in err, err
    no_tokenizer = target_factory(with_tokenizer=False).path
    (tmp_path / "plain.txt").write_text("hello world . " * 50)
    rc, _, err = run_train(["--target", no_tokenizer, "--data", tmp_path / "plain.txt", "--out", tmp_path / "b",
                            *small])
    assert rc == 2 and "--data needs the target's tokenizer.json" in err, err
    # Every response starts past --seq-len: no conversation leaves a block to supervise.
    long_prompt = {"prompt": " ".join(["hello"] * 40), "response": "world"}
    (tmp_path / "chats.jsonl").write_text(json.dumps(long_prompt) + "\n")
    rc, _, err = run_train(["--target", tiny_target.path, "--data", tmp_path / "chats.jsonl", "--out", tmp_path / "c",
                            *small])
    assert rc == 2 and ("no conversation has a response to train on (0 whose response the chat template "
                        "rewrites, 1 without two response tokens in their first --seq-len 16)") in err, err


def test_anchor_rule_and_supervision_by_definition():
    g = torch.Generator().manual_seed(0)
    B, T, N, K = 3, 20, 6, 3
    mask = torch.rand(B, T, generator=g) < 0.6
    doc = torch.cumsum(torch.rand(B, T, generator=g) < 0.2, 1)
    mask[2] = False
    mask[2, 5:8], doc[2] = True, 0  # two candidates only: the rest of the row's blocks are fillers
    allowed = data.anchor_candidates(mask, doc)
    for b in range(B):
        for a in range(T - 1):
            assert allowed[b, a] == (mask[b, a] and mask[b, a + 1] and doc[b, a] == doc[b, a + 1])
    anchors, keep = data.sample_anchors(B, T, N, torch.Generator().manual_seed(1), allowed)
    for b in range(B):
        real = anchors[b][keep[b]].tolist()
        assert len(real) == min(N, int(allowed[b].sum())) and len(set(real)) == len(real) and real == sorted(real)
        assert all(allowed[b, a] for a in real) and keep[b].tolist() == sorted(keep[b].tolist(), reverse=True)
    assert keep[2].sum() == 2
    valid = data.supervised(anchors, keep, K, T, mask, doc)
    for b in range(B):
        for i in range(N):
            a, ok = anchors[b, i].item(), keep[b, i].item()
            for j in range(K):
                ok = ok and a + j + 1 < T and mask[b, a + j + 1].item() and doc[b, a + j + 1] == doc[b, a]
                assert valid[b, i, j].item() == ok, (b, i, j)
    # Plain text: every position allowed is exactly the unrestricted draw (existing runs are unchanged).
    free, keep_all = data.sample_anchors(B, T, N, torch.Generator().manual_seed(1))
    same, keep_same = data.sample_anchors(B, T, N, torch.Generator().manual_seed(1), torch.ones(B, T - 1, dtype=torch.bool))
    assert torch.equal(free, same) and keep_all.all() and keep_same.all()


def test_best_fit_packing_keeps_documents_whole():
    rng = random.Random(0)
    docs = [([rng.randrange(1, 50) for _ in range(n)], [rng.random() < 0.5 for _ in range(n)])
            for n in [rng.randrange(1, 12) for _ in range(40)] + [15, 30]]
    corpus, st = data.pack_documents(docs, 16, pad_id=0)
    assert st["documents"] == 42 and st["cut"] == 1 and st["rows"] == len(corpus)
    assert st["rows"] <= sum(min(len(d[0]), 16) for d in docs) // 16 + 3  # nearly full rows
    seen = []
    for r in range(len(corpus)):
        row_doc = corpus.doc[r].tolist()
        for j in sorted(set(row_doc) - {-1}):
            where = [t for t, x in enumerate(row_doc) if x == j]
            assert where == list(range(where[0], where[-1] + 1))  # contiguous
            seen.append((tuple(corpus.tokens[r, where].tolist()), tuple(corpus.loss_mask[r, where].tolist())))
        pad = [t for t, x in enumerate(row_doc) if x == -1]
        assert pad == list(range(16 - len(pad), 16)) and not corpus.loss_mask[r, pad].any()
    want = sorted((tuple(ids[:16]), tuple(m[:16])) for ids, m in docs)
    assert sorted(seen) == want


def test_no_pack_is_one_conversation_a_row_as_the_authors_train():
    """--no-pack: each conversation its own row, in order, padded; the anchor budget is then per conversation:
    a short response is covered whole (min(candidates, N) anchors), where packing shares N across the row."""
    rng = random.Random(1)
    docs = [([rng.randrange(1, 50) for _ in range(n)], [t >= 2 for t in range(n)]) for n in (5, 9, 16, 20)]
    corpus, st = data.pack_documents(docs, 16, pad_id=0, pack=False)
    assert st["rows"] == len(corpus) == 4 and st["cut"] == 1
    for r, (ids, m) in enumerate(docs):
        n = min(len(ids), 16)
        assert corpus.tokens[r, :n].tolist() == ids[:n] and corpus.loss_mask[r, :n].tolist() == m[:n]
        assert corpus.doc[r].tolist() == [0] * n + [-1] * (16 - n) and not corpus.loss_mask[r, n:].any()
    N = 8
    allowed = data.anchor_candidates(corpus.loss_mask, corpus.doc)
    _, keep = data.sample_anchors(4, 16, N, torch.Generator().manual_seed(0), allowed)
    assert keep.sum(1).tolist() == [min(int(allowed[r].sum()), N) for r in range(4)] == [2, 6, 8, 8]
    packed, _ = data.pack_documents(docs[:2], 16, pad_id=0)  # 5 + 9 tokens share one row, and its 8 anchors
    assert len(packed) == 1


def test_a_response_past_the_cut_is_skipped(tiny_target):
    """A conversation whose response starts after --seq-len tokens would take a row and give no block."""
    tok = text.Tokenizer(str(tiny_target.path))
    docs, _, _ = data.encode_chats(tok, [("x:1", CONVERSATION)], ["<|im_end|>"])
    first = docs[0][1].index(True)
    assert data.encode_chats(tok, [("x:1", CONVERSATION)], ["<|im_end|>"], seq_len=first + 1) == ([], 0, 1)
    assert len(data.encode_chats(tok, [("x:1", CONVERSATION)], ["<|im_end|>"], seq_len=first + 2)[0]) == 1


def test_document_mask_by_definition():
    doc = torch.tensor([[0, 0, 1, 1, 1, -1], [0, 1, 1, 2, 2, 2]])
    m = data.document_mask(doc)
    for b in range(2):
        for q in range(6):
            for k in range(6):
                assert m[b, q, k] == (k <= q and doc[b, q] == doc[b, k])
    anchors = torch.tensor([[1, 3], [2, 4]])
    bm = train.block_mask(anchors, 6, 2, doc)
    for b in range(2):
        for row in range(4):
            a = anchors[b, row // 2].item()
            for p in range(6):
                assert bm[b, row, p] == (p < a and doc[b, p] == doc[b, a])


def test_packed_row_computes_what_each_document_computes_alone(tiny_target):
    """The target's capture and the drafter's blocks of a packed row (positions 0..T-1 along the row, attention
    within each document) equal those of each document run alone from position 0, and drafter_loss on the
    row equals the losses of the blocks built one by one on the documents alone."""
    target = checkpoint.load_target(str(tiny_target.path))
    args = train.Args(block_size=3, depth=2, markov="gated", markov_rank=8, init_std=0.3, seed=5)
    cfg = train.drafter_config(args, target, str(tiny_target.path))
    d = train.build_drafter(cfg, args, target, "cpu").eval()
    g = torch.Generator().manual_seed(3)
    lens = [5, 7, 4]
    docs = [torch.randint(0, 64, (n,), generator=g) for n in lens]
    tokens = torch.cat(docs + [torch.zeros(2, dtype=torch.long)])[None]  # + 2 padding tokens
    T, K = tokens.shape[1], d.cfg.block_size
    doc = torch.tensor([[i for i, n in enumerate(lens) for _ in range(n)] + [-1, -1]])
    mask = torch.ones(1, T, dtype=torch.bool)
    mask[0, -2:] = False
    mask[0, 5] = False  # the second document's first token is prompt
    starts = [0, 5, 12]
    anchors = torch.tensor([[0, 2, 6, 9, 12, 14]])
    with torch.no_grad():
        packed_h, packed_f = target.hidden(tokens, capture=d.cfg.target_layer_ids, mask=data.document_mask(doc))
        for s, x in zip(starts, docs):
            h, f = target.hidden(x[None], capture=d.cfg.target_layer_ids)
            assert torch.allclose(packed_h[0, s:s + len(x)], h[0], atol=1e-4)
            assert torch.allclose(packed_f[0, s:s + len(x)], f[0], atol=1e-4)
        hb = train.block_forward(d, packed_f, tokens, anchors, doc)[0]
        keep = torch.ones_like(anchors, dtype=torch.bool)
        loss, terms, valid = train.drafter_loss(d, target, tokens, anchors, args, keep=keep, loss_mask=mask, doc=doc)
        z_ref, t_ref, lab_ref, val_ref, c_ref = [], [], [], [], []
        for i, a in enumerate(anchors[0].tolist()):
            j = doc[0, a].item()
            x, o = docs[j], starts[j]
            _, f = target.hidden(x[None], capture=d.cfg.target_layer_ids)
            d.setup_caches(1, len(x) + K)
            if a > o:
                d.commit_context(f[:, :a - o], torch.arange(a - o)[None])
            h, U = d(x[a - o:a - o + 1], torch.tensor([a - o]))
            assert torch.allclose(hb[i], h[0], atol=1e-4), f"block at {a}"
            lab = [x[a - o + k + 1].item() if a - o + k + 1 < len(x) else 0 for k in range(K)]
            ok = [a - o + k + 1 < len(x) and bool(mask[0, a + k + 1]) for k in range(K)]
            val_ref.append(torch.tensor(ok).int().cumprod(0).bool())
            prev = torch.tensor([[x[a - o].item()] + lab[:-1]])
            state, z = None, U.clone()
            for k in range(K):
                bias, state = d.markov_head.step(h[:, k], prev[:, k], state)
                z[:, k] += bias
            logits, _ = target(x[None])
            z_ref.append(z[0])
            t_ref.append(logits[0, [min(a - o + k, len(x) - 1) for k in range(K)]])
            lab_ref.append(torch.tensor(lab))
            c_ref.append(torch.logit(d.confidence(h, prev)[0].double()).float())
        ref = train.distill_losses(torch.stack(z_ref), torch.stack(t_ref), torch.stack(lab_ref), torch.stack(val_ref),
                                   torch.stack(c_ref), args.gamma)
    assert torch.equal(valid[0], torch.stack(val_ref))
    for k in ("ce", "tv", "conf"):
        assert terms[k].item() == pytest.approx(ref[k].item(), rel=1e-4, abs=1e-5), k


def write_chats(path, n, seed=0):
    words = "def x = y + 1 : return if hello world else print ( z ) , 0 1 2 3".split()
    rng = random.Random(seed)
    say = lambda k: " ".join(rng.choice(words) for _ in range(k))  # noqa: E731
    with open(path, "w") as f:
        for i in range(n):
            if i % 3 == 0:
                rec = {"prompt": say(3), "response": say(rng.randrange(4, 12))}
            else:
                rec = {"messages": [{"role": "user", "content": say(2)}, {"role": "assistant", "content": say(5)},
                                    {"role": "user", "content": say(2)}, {"role": "assistant", "content": say(6)}]}
            f.write(json.dumps(rec) + "\n")
    return path


def test_chat_records_train(tiny_target, tmp_path):
    chats = write_chats(tmp_path / "chat.jsonl", 12)
    rc, res, err = run_train(["--target", tiny_target.path, "--data", chats, "--out", tmp_path / "o", "--steps", 3,
                              "--seq-len", 40, "--batch-size", 2, "--block-size", 3, "--depth", 1, "--markov-rank", 8],
                             progress=True)
    assert rc == 0, err
    assert "12 conversations packed into" in err and "0 skipped" in err and "ChatML" not in err
    # what the minutes before the first step are spent on, said before them
    assert err.index("--data: rendering and tokenizing 12 conversations\n") < err.index("packed into"), err
    assert "39 anchors each" in err  # --anchors-per-seq 512 clamped to the row
    assert len(res["losses"]) == 3 and all(x == x for x in res["losses"])
    checkpoint.load_drafter(str(tmp_path / "o"), checkpoint.load_target(str(tiny_target.path)))
    # --no-pack: one conversation a row (the authors' layout); on plain text it is refused.
    rc, res, err = run_train(["--target", tiny_target.path, "--data", chats, "--out", tmp_path / "n", "--steps", 2,
                              "--seq-len", 40, "--batch-size", 2, "--block-size", 3, "--depth", 1, "--markov-rank", 8,
                              "--no-pack"])
    assert rc == 0, err
    assert "12 conversations one a row: 12 sequences" in err
    (tmp_path / "plain.txt").write_text("hello world . " * 100)
    rc, _, err = run_train(["--target", tiny_target.path, "--data", tmp_path / "plain.txt", "--out", tmp_path / "p",
                            "--steps", 1, "--seq-len", 16, "--no-pack"])
    assert rc == 2 and "--no-pack: --data" in err and "plain text" in err, err


def test_chat_records_on_a_target_without_a_template_say_how_they_are_rendered(tiny_target, tmp_path):
    """A target without a chat template: the records are rendered in Qwen3's ChatML by hand, which the data
    line says (it was silent, and eval.py decodes such a target's prompts without chat)."""
    from conftest import copy_target, edit_json

    target = copy_target(tiny_target.path, tmp_path / "t")
    edit_json(target / "tokenizer_config.json", lambda c: c.pop("chat_template"))
    chats = write_chats(tmp_path / "chat.jsonl", 4)
    rc, _, err = run_train(["--target", target, "--data", chats, "--out", tmp_path / "o", "--steps", 1,
                            "--seq-len", 40, "--batch-size", 2, "--block-size", 3, "--depth", 1, "--markov-rank", 8])
    assert rc == 0 and "; rendered as Qwen3's ChatML, the target having no chat template\n" in err, err


# The authors' Qwen3DSparkModel (deepspec/modeling/dspark/qwen3/modeling.py, markov_head.py, common.py), read
# and written down here without importing it: the config fields its __init__ asserts, and its parameters.
DEEPSPEC_REQUIRED = ("target_layer_ids", "mask_token_id", "num_anchors", "enable_confidence_head", "markov_rank",
                     "block_size", "num_hidden_layers", "layer_types", "hidden_size", "vocab_size", "rms_norm_eps")
DEEPSPEC_LAYER = ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
                  "self_attn.o_proj.weight", "self_attn.q_norm.weight", "self_attn.k_norm.weight",
                  "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight", "input_layernorm.weight",
                  "post_attention_layernorm.weight")
DEEPSPEC_HEADS = {"vanilla": ("markov_head.markov_w1.weight", "markov_head.markov_w2.weight"),
                  "gated": ("markov_head.gate_proj.weight", "markov_head.gate_proj.bias"),
                  "rnn": ("markov_head.joint_proj.weight", "markov_head.joint_proj.bias")}


def test_num_anchors_is_what_a_row_trained(tiny_target):
    """--anchors-per-seq's default (DeepSpec's 512) is cut to --seq-len - 1: the config records the 63 a 64-token
    row trained, as the banner and W&B's anchors_resolved say (it said 512)."""
    target = checkpoint.load_target(str(tiny_target.path))
    for seq_len, want in ((64, 63), (1024, 512)):
        args = train.Args(target=str(tiny_target.path), block_size=4, depth=2, markov_rank=8, seq_len=seq_len)
        cfg = train.drafter_config(args, target, str(tiny_target.path))
        assert train.drafter_json(args, cfg)["num_anchors"] == want


@pytest.mark.parametrize("markov,confidence", [("vanilla", True), ("rnn", True), ("none", False)])
def test_checkpoint_is_what_deepspec_reads(tiny_target, tmp_path, markov, confidence):
    from safetensors import safe_open

    target = checkpoint.load_target(str(tiny_target.path))
    args = train.Args(block_size=4, depth=2, markov=markov, markov_rank=8, confidence=confidence,
                      confidence_with_markov=confidence and markov != "none")
    cfg = train.drafter_config(args, target, str(tiny_target.path))
    d = train.build_drafter(cfg, args, target, "cpu")
    train.save_drafter(str(tmp_path), d, str(tiny_target.path), configs.config_json(str(tiny_target.path), d.cfg, 512))
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen3DSparkModel"] and cfg["model_type"] == "qwen3"
    assert all(k in cfg for k in DEEPSPEC_REQUIRED), [k for k in DEEPSPEC_REQUIRED if k not in cfg]
    assert cfg["layer_types"] == ["full_attention"] * 2 and cfg["num_anchors"] == 512 and cfg["num_target_layers"] == 3
    assert cfg["markov_rank"] == (0 if markov == "none" else 8)  # their build_markov_head: rank 0 = no head
    if cfg["markov_rank"] > 0:
        assert cfg["markov_head_type"] == markov
    if cfg["enable_confidence_head"]:
        assert isinstance(cfg["confidence_head_with_markov"], bool)
    H, V, r = 32, 64, cfg["markov_rank"]
    want = {f"layers.{i}.{n}" for i in range(2) for n in DEEPSPEC_LAYER}
    want |= {"embed_tokens.weight", "lm_head.weight", "norm.weight", "fc.weight", "hidden_norm.weight"}
    if markov != "none":
        want |= set(DEEPSPEC_HEADS["vanilla"]) | set(DEEPSPEC_HEADS[markov] if markov != "vanilla" else ())
    if confidence:
        want |= {"confidence_head.proj.weight", "confidence_head.proj.bias"}
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        assert set(f.keys()) == want
        shape = lambda k: tuple(f.get_slice(k).get_shape())  # noqa: E731
        assert shape("fc.weight") == (H, 2 * H) and shape("embed_tokens.weight") == shape("lm_head.weight") == (V, H)
        if markov != "none":
            assert shape("markov_head.markov_w1.weight") == (V, r) and shape("markov_head.markov_w2.weight") == (V, r)
        if markov == "rnn":
            assert shape("markov_head.joint_proj.weight") == (3 * r, 2 * r + H)
        if confidence:
            assert shape("confidence_head.proj.weight") == (1, H + r) and shape("confidence_head.proj.bias") == (1,)
    checkpoint.load_drafter(str(tmp_path), target)  # and ours reads it


def test_word_tokenizer_has_chatml_specials():
    tok = build_tokenizer(64)
    assert tok.encode("<|im_start|>user\nhello<|im_end|>").ids == [IM_START_ID, 6, 18, IM_END_ID]


def test_a_new_heads_norms_and_own_init_survive_the_random_fill(tiny_target, monkeypatch):
    """build_drafter fills every parameter by name (N(0, std), norms 1, biases 0): a new head's LayerNorm not
    named *norm, and a parameter it initialises itself (through `init_`), keep their meaning."""
    from torch import nn

    class ScaledMarkov(dr.VanillaMarkov):
        kind = "scaled"

        def __init__(self, H, V, r):
            super().__init__(H, V, r)
            self.ln = nn.LayerNorm(r)
            self.scale = nn.Parameter(torch.ones(r))

        def init_(self):
            self.scale.fill_(1.0)

        def step(self, h, prev, state):
            return self.markov_w2(self.ln(self.markov_w1(prev)) * self.scale), state

    target = checkpoint.load_target(str(tiny_target.path))
    monkeypatch.setitem(dr.MARKOV_HEADS, "scaled", ScaledMarkov)  # a head of that name comes back after
    args = train.Args(block_size=3, depth=1, markov="scaled", markov_rank=8)
    cfg = train.drafter_config(args, target, str(tiny_target.path))
    d = train.build_drafter(cfg, args, target, "cpu")
    assert torch.equal(d.markov_head.ln.weight, torch.ones(8)) and torch.equal(d.markov_head.scale, torch.ones(8))
    assert d.markov_head.markov_w1.weight.std() > 0  # the rest is filled as before
