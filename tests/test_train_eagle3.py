"""train.py --drafter-kind eagle3: DeepSpec's training-time-test loss, its gradients and its logged metrics
equal those DeepSpec's own code computed (tests/golden/eagle3/loss_fixture.*); the online target features
are the ones its cache stores; each unrolled step equals the decode chain; packed documents train as rows
of their own; short runs lower the loss and write DeepSpec's checkpoint layout, which loads and decodes
losslessly; a resumed run and a 2-process run continue exactly.

The fixture: deepspec.modeling.eagle3.loss.compute_eagle3_loss (DeepSpec commit afdfa7c, float32, CPU) on a
B=2, T=24 batch (row 1 padded from 19, a loss mask with zeros) for the drafter tests/golden/eagle3/eagle3 and
its 8-layer target tests/golden/eagle3/target: the loss, each step's, the 14 trainable parameters' gradients
and the metrics DeepSpec logged (loss_fixture.json).
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from conftest import REPO_ROOT
from safetensors import safe_open
from safetensors.torch import load_file
from test_train import ckpt, decode_ids, near_bigram, run_train, write_ids  # noqa: F401 (a fixture)
from test_train_data import CONVERSATION, write_chats
from test_train_dist import curve, torchrun, weights

import train
from support import checkpoint, data, text
from support.checkpoint import published

torch.set_num_threads(1)

GOLDEN = REPO_ROOT / "tests" / "golden" / "eagle3"
TOL = 1e-5


@pytest.fixture(scope="module")
def golden():
    """DeepSpec's pair (the drafter trainable, as in training), the fixture's tensors and its record."""
    target = checkpoint.load_target(str(GOLDEN / "target"))
    drafter = checkpoint.load_drafter(str(GOLDEN / "eagle3"), target).requires_grad_(True)
    t = load_file(str(GOLDEN / "loss_fixture.safetensors"))
    info = json.loads((GOLDEN / "loss_fixture.json").read_text())
    doc = torch.where(t["attention_mask"].bool(), 0, -1)  # one document a row, -1 on the padding
    return target, drafter, t, info, doc


def eagle3_args(**kw) -> train.Args:
    return train.Args(drafter_kind="eagle3", **kw)


# ----------------------------------------------------------------------------------------
# The loss, exactly DeepSpec's

def test_ttt_loss_gradients_and_metrics_equal_deepspecs(golden):
    """ttt_loss on the fixture's batch (its cached features and target logits) == compute_eagle3_loss: the
    loss, each step's loss, every trainable parameter's gradient (named as DeepSpec's: q/k/v, gate/up
    split) to 1e-5; and the train metrics DeepSpec logged (accuracy@j, accept_rate@j, tau_greedy,
    tau_probabilistic)."""
    _, drafter, t, info, doc = golden
    drafter.zero_grad(set_to_none=True)
    loss, stats = train.ttt_loss(drafter, t["target_hidden_states"], t["target_logits"], t["input_ids"],
                                 info["ttt_length"], info["step_loss_decay"], t["loss_mask"], doc)
    loss.backward()
    assert abs(loss.item() - t["loss"].item()) < TOL
    assert [s.item() for s in stats["step"]] == pytest.approx(info["per_step_loss"], abs=TOL)
    grads = published({n: p.grad for n, p in drafter.named_parameters()})
    assert sorted(grads) == sorted(info["grad_params"]) == sorted(k[5:] for k in t if k.startswith("grad."))
    for name, g in grads.items():
        assert (g - t["grad." + name]).abs().max().item() < TOL, name
    drafter.zero_grad(set_to_none=True)

    m = train.summarize_eagle3(train.eagle3_sums(loss, stats), info["ttt_length"])
    ds = info["metrics_from_deepspec_add_metric"]
    for j in range(info["ttt_length"]):
        assert m[f"acc@{j}"] == pytest.approx(ds[f"train/accuracy@{j}"], abs=TOL)
        assert m[f"accept@{j}"] == pytest.approx(ds[f"train/accept_rate@{j}"], abs=TOL)
        assert m[f"loss@{j}"] == pytest.approx(ds[f"train/ploss_{j}"], abs=TOL)
        assert stats["valid"][j].sum().item() == ds[f"train/valid_tokens@{j}"]
    assert m["tau_greedy"] == pytest.approx(ds["train/tau_greedy"], abs=TOL)
    assert m["tau"] == pytest.approx(ds["train/tau_probabilistic"], abs=TOL)
    assert m["loss"] == pytest.approx(ds["train/loss"], abs=TOL)


def test_online_features_are_deepspecs_cached_ones(golden):
    """The target run online (Transformer.hidden, the padding masked off as a document of its own) gives the
    features DeepSpec's cache holds (the raw outputs of target_layer_ids) and its logits at every real
    position; eagle3_loss, which runs it, gives the fixture's loss."""
    target, drafter, t, _, doc = golden
    real = t["attention_mask"].bool()
    with torch.no_grad():
        hidden, features = target.hidden(t["input_ids"], capture=drafter.cfg.target_layer_ids,
                                         mask=train.data.document_mask(doc))
        logits = target.lm_head(hidden)
        assert (features - t["target_hidden_states"])[real].abs().max().item() < TOL
        assert (logits - t["target_logits"])[real].abs().max().item() < TOL
        loss, _ = train.eagle3_loss(drafter, target, t["input_ids"], eagle3_args(), loss_mask=t["loss_mask"], doc=doc)
    assert abs(loss.item() - t["loss"].item()) < TOL


def test_positions_and_mask_by_hand():
    """pm_0: the loss mask without each row's (document's) last position; pm_j[i] = pm_0[i + j], within i's
    document. The mask: causal over step 0's keys (within the document), the own index in later steps."""
    loss_mask = torch.tensor([[0, 1, 1, 1, 1, 1, 0, 0]], dtype=torch.bool)
    doc = torch.tensor([[0, 0, 0, 0, 1, 1, 1, -1]])
    pm = train.ttt_positions(loss_mask, None, 1, 8, 3)
    assert pm[:, 0].int().tolist() == [[0, 1, 1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 0, 0, 0, 0]]
    pm = train.ttt_positions(None, None, 1, 4, 2)  # a full window: all but the last position, shifted
    assert pm[:, 0].int().tolist() == [[1, 1, 1, 0], [1, 1, 0, 0]]
    pm = train.ttt_positions(loss_mask, doc, 1, 8, 3)  # documents 0..3 and 4..6: each one's last position off
    assert pm[:, 0].int().tolist() == [[0, 1, 1, 0, 1, 1, 0, 0], [1, 1, 0, 0, 1, 0, 0, 0], [1, 0, 0, 0, 0, 0, 0, 0]]
    m = train.ttt_mask(3, 3)
    assert m.shape == (1, 3, 9)
    assert m[0].int().tolist() == [[1, 0, 0, 1, 0, 0, 1, 0, 0], [1, 1, 0, 0, 1, 0, 0, 1, 0], [1, 1, 1, 0, 0, 1, 0, 0, 1]]
    m = train.ttt_mask(4, 2, torch.tensor([[0, 0, 1, 1]]))
    assert m[0, :, :4].int().tolist() == [[1, 0, 0, 0], [1, 1, 0, 0], [0, 0, 1, 0], [0, 0, 1, 1]]


def test_every_draft_of_a_chat_response_is_a_target(tiny_target, tmp_path, monkeypatch):
    """Chat records: every response token a decode chain drafts is a step's target, the response's second
    token included (each response's first draft, from the prompt's last position): `drafting_mask`
    reaches two tokens before each response, as DeepSpec's mask (from the empty think block) does. The
    mask as it is left that token to no step. The mask never reaches into the document before; a chat
    run's batches are read through it."""
    tok = text.Tokenizer(str(tiny_target.path))
    (ids, mask), = data.encode_chats(tok, [("x:1", CONVERSATION)], ["<|im_end|>"])[0]
    T, steps = len(ids), 3
    loss_mask = torch.tensor(mask)[None]
    doc = torch.zeros(1, T, dtype=torch.long)

    def targets(read_mask):
        valid = train.ttt_positions(read_mask, doc, 1, T, steps)  # index i, step j: x_{i+j+2}
        return {i + j + 2 for j in range(steps) for i in range(T) if valid[j, 0, i]}

    response = {k for k in range(T) if mask[k]}
    first = {k for k in response if not mask[k - 1]}  # the target's own token after a prompt
    second = {k + 1 for k in first}
    assert len(first) == 2 and second <= response
    assert response - first <= targets(train.drafting_mask(loss_mask, doc))
    assert not second & targets(loss_mask)
    two_docs = torch.tensor([[0, 0, 0, 1, 1, 1]])
    extended = train.drafting_mask(torch.tensor([[1, 0, 0, 0, 1, 1]], dtype=torch.bool), two_docs)
    assert extended.int().tolist() == [[1, 0, 0, 1, 1, 1]]
    read = []
    own = train.drafting_mask

    def spy(loss_mask, doc):
        read.append(loss_mask)
        return own(loss_mask, doc)

    monkeypatch.setattr(train, "drafting_mask", spy)
    chats = write_chats(tmp_path / "chat.jsonl", 4)
    rc, _, err = run_train(["--drafter-kind", "eagle3", "--target", tiny_target.path, "--data", chats,
                            "--seq-len", 40, "--ttt-length", 2, "--steps", 1, "--out", tmp_path / "out"])
    assert rc == 0, err
    assert len(read) == 1


# ----------------------------------------------------------------------------------------
# Training forward == inference

def test_unrolled_steps_equal_the_decode_chain(golden):
    """Step j's logits at index i == the decode path's (speculate.py's): commit_context of positions 0..i
    (features, the tokens after them), then j drafting steps fed the true next tokens."""
    target, drafter, t, _, _ = golden
    tokens = t["input_ids"][:1]
    T, S = tokens.shape[1], 4
    with torch.no_grad():
        _, features = target.hidden(tokens, capture=drafter.cfg.target_layer_ids)
        steps = [drafter.logits(h)[0] for h in train.ttt_forward(drafter, features, tokens, S)]
        drafter.setup_caches(1, T + S + 2)
        for i in (0, 5, 13, T - S - 2):
            drafter.commit_context(features[:, :i + 1], torch.arange(i + 1)[None], following=tokens[:, 1:i + 2],
                                   last=torch.tensor([i]))
            h = drafter.carried[:1]
            for j in range(S):
                assert torch.allclose(drafter.logits(h)[0], steps[j][i], atol=1e-4), (i, j)
                h = drafter.step(h, tokens[:, i + j + 2], torch.tensor([i + j + 1]))


def test_packed_documents_train_as_rows_of_their_own(golden):
    """Two documents packed in one row (and padding) give each step the loss and the gradients they give
    in rows of their own: the mask keeps each within its document, RoPE sees distances only."""
    target, drafter, _, _, _ = golden
    g = torch.Generator().manual_seed(4)
    a, b = torch.randint(0, 48, (9,), generator=g), torch.randint(0, 48, (7,), generator=g)
    T = 20
    packed = torch.cat([a, b, torch.zeros(4, dtype=torch.long)])[None]
    packed_doc = torch.tensor([[0] * 9 + [1] * 7 + [-1] * 4])
    rows = torch.zeros(2, T, dtype=torch.long)
    rows[0, :9], rows[1, :7] = a, b
    rows_doc = torch.full((2, T), -1)
    rows_doc[0, :9], rows_doc[1, :7] = 0, 0
    args = eagle3_args(ttt_length=5)

    def run(tokens, d):
        drafter.zero_grad(set_to_none=True)
        loss, stats = train.eagle3_loss(drafter, target, tokens, args, loss_mask=d >= 0, doc=d, den=1.0)
        loss.backward()
        grads = {n: p.grad.clone() for n, p in drafter.named_parameters()}
        return [s.item() for s in stats["step"]], grads, stats["valid"].sum().item()

    steps_p, grads_p, n_p = run(packed, packed_doc)
    steps_r, grads_r, n_r = run(rows, rows_doc)
    drafter.zero_grad(set_to_none=True)
    assert n_p == n_r == (8 + 7 + 6 + 5 + 4) + (6 + 5 + 4 + 3 + 2)
    assert steps_p == pytest.approx(steps_r, rel=1e-5)
    for n in grads_p:
        assert torch.allclose(grads_p[n], grads_r[n], atol=1e-5, rtol=1e-4), n


# ----------------------------------------------------------------------------------------
# Short runs

def test_training_lowers_loss_writes_deepspecs_layout_and_decodes_losslessly(near_bigram, tmp_path):  # noqa: F811
    """30 steps lower the loss; the checkpoint is DeepSpec's Eagle3 layout (config keys, separate q/k/v, the
    target's embedding and lm_head), load_drafter reads it, and greedy speculative decoding with it equals
    the target alone, its drafts accepted (τ 1.0 untrained)."""
    tdir, ids = near_bigram
    out = tmp_path / "eagle3"
    rc, res, err = run_train(["--drafter-kind", "eagle3", "--target", tdir, "--data-ids", ids, "--out", out,
                              "--steps", 30, "--lr", 3e-3, "--warmup-frac", 0.0, "--seq-len", 32, "--batch-size", 4,
                              "--ttt-length", 4])
    assert rc == 0, err
    assert "layout=eagle3" in err and "4 TTT steps" in err, err
    losses = res["losses"]
    assert len(losses) == 30 and all(math.isfinite(x) for x in losses)
    assert sum(losses[-5:]) < 0.8 * sum(losses[:5]), losses  # toward the target distribution's entropy
    log = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]
    assert {"loss", "tau", "tau_greedy", "loss@3", "acc@3", "accept@3"} <= set(log[-1])
    assert log[-1]["tau"] > log[0]["tau"] and log[-1]["acc@0"] > log[0]["acc@0"]

    cfg = json.loads((out / "config.json").read_text())
    with open(f"{tdir}/config.json") as f:
        tcfg = json.load(f)
    assert cfg["architectures"] == ["Qwen3Eagle3Model"]
    assert (cfg["num_hidden_layers"], cfg["draft_num_hidden_layers"], cfg["layer_types"]) == (1, 1, ["full_attention"])
    assert (cfg["num_target_layers"], cfg["target_layer_ids"], cfg["ttt_length"]) == (3, [0, 1], 4)
    assert cfg["step_loss_decay"] == 0.8 and cfg["tie_word_embeddings"] is False
    assert all(cfg[k] == tcfg[k] for k in ("hidden_size", "intermediate_size", "vocab_size", "num_attention_heads",
                                           "num_key_value_heads", "head_dim", "rms_norm_eps"))
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    want = {"fc.weight", "norm.weight", "embed_tokens.weight", "lm_head.weight"} | {
        f"layers.0.{n}.weight" for n in ("hidden_norm", "input_layernorm", "post_attention_layernorm", "mlp.gate_proj",
                                         "mlp.up_proj", "mlp.down_proj", *(f"self_attn.{p}" for p in (
                                             "q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm")))}
    assert names == want
    target = checkpoint.load_target(tdir)
    d = checkpoint.load_drafter(str(out), target)
    assert d.cfg.layout == "eagle3" and d.cfg.num_drafts == 4 and d.cfg.target_layer_ids == (0, 1)

    prompts = ((1, 2, 3, 4), (7, 30, 2), (11,), (40, 5))
    base, _ = decode_ids(tdir, None, tmp_path, prompts)
    spec, summary = decode_ids(tdir, out, tmp_path, prompts)
    assert spec == base
    assert summary["acceptance_length"] > 1.5, summary  # 1.0 untrained, 1.9 here


def test_resume_equals_uninterrupted_run(tiny_target, tmp_path):
    """Stopped at step 3 and resumed: the losses, the weights and AdamW's state of the uninterrupted run; a
    resumed run must repeat the Eagle3 flags, and a DSpark run is not resumed as an Eagle3 one."""
    ids = write_ids(tmp_path / "ids.jsonl", 6, 24, 64, seed=1)
    common = ["--drafter-kind", "eagle3", "--target", tiny_target.path, "--data-ids", ids, "--steps", 6,
              "--warmup-frac", 0.2, "--seq-len", 24, "--batch-size", 2, "--ttt-length", 3]
    rc, straight, err = run_train(common + ["--out", tmp_path / "a"])
    assert rc == 0, err
    rc, first, err = run_train(common + ["--out", tmp_path / "b", "--stop-at", 3])
    assert rc == 0, err
    rc, second, err = run_train(common + ["--out", tmp_path / "c", "--resume", tmp_path / "b"])
    assert rc == 0, err
    assert (second["start"], second["step"]) == (3, 6)
    assert first["losses"] + second["losses"] == pytest.approx(straight["losses"], rel=1e-6)
    wa, wc = load_file(str(tmp_path / "a" / "model.safetensors")), load_file(str(tmp_path / "c" / "model.safetensors"))
    assert wa.keys() == wc.keys() and all(torch.allclose(wa[k], wc[k], atol=1e-6, rtol=0) for k in wa)
    sa = load_file(str(ckpt(tmp_path / "a") / "training_state.safetensors"))
    sc = load_file(str(ckpt(tmp_path / "c") / "training_state.safetensors"))
    assert sa.keys() == sc.keys() and all(torch.allclose(sa[k], sc[k], atol=1e-6, rtol=0) for k in sa)
    rc, _, err = run_train(common[:-1] + [4, "--out", tmp_path / "d", "--resume", tmp_path / "b"])
    assert rc == 2 and "--ttt-length was 3, now 4" in err, err
    rc, _, err = run_train(["--target", tiny_target.path, "--data-ids", ids, "--steps", 6, "--seq-len", 24,
                            "--out", tmp_path / "e", "--resume", tmp_path / "b"])
    assert rc == 2 and "--drafter-kind was 'eagle3', now 'dspark'" in err, err


def test_bfloat16_training_on_cpu(tiny_target, tmp_path):
    """--dtype bfloat16: the target and the unrolled steps run under autocast (float32 RoPE and masks)."""
    ids = write_ids(tmp_path / "ids.jsonl", 4, 24, 64)
    rc, res, err = run_train(["--drafter-kind", "eagle3", "--target", tiny_target.path, "--data-ids", ids, "--out",
                              tmp_path / "o", "--steps", 2, "--seq-len", 24, "--batch-size", 2, "--device", "cpu",
                              "--dtype", "bfloat16"])
    assert rc == 0, err
    assert len(res["losses"]) == 2 and all(math.isfinite(x) for x in res["losses"])


def test_two_processes_equal_one_on_packed_chats(tiny_target, tmp_path):
    """Chat records packed whole into rows (documents, loss masks, padding): one process with --grad-accum 2
    == two gloo processes (torchrun) with --grad-accum 1, steps 1-2, then one process resuming at 4 x 1."""
    chats = write_chats(tmp_path / "chat.jsonl", 30)
    base = ["--drafter-kind", "eagle3", "--target", tiny_target.path, "--data", chats, "--seq-len", 40,
            "--ttt-length", 3, "--warmup-frac", 0.0, "--lr", 3e-3, "--steps", 4]
    rc, one, err = run_train(base + ["--out", tmp_path / "one", "--batch-size", 2, "--grad-accum", 2])
    assert rc == 0, err
    assert "packed into" in err
    p = torchrun(base + ["--out", tmp_path / "two", "--batch-size", 2, "--stop-at", 2], tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "global batch 4 = 2 x 1 x 2 process(es)" in p.stderr
    rc, resumed, err = run_train(base + ["--out", tmp_path / "three", "--resume", tmp_path / "two",
                                         "--batch-size", 1, "--grad-accum", 4])
    assert rc == 0 and resumed["start"] == 2, err
    assert curve(tmp_path / "two") + curve(tmp_path / "three") == pytest.approx(one["losses"], rel=1e-5)
    wa, wc = weights(tmp_path / "one"), weights(tmp_path / "three")
    assert wa.keys() == wc.keys() and all(torch.allclose(wa[k], wc[k], atol=1e-5, rtol=1e-4) for k in wa)


@pytest.mark.parametrize("flags,needle", [
    (["--depth", 2], "--depth 2: changes nothing with --drafter-kind eagle3"),
    (["--no-confidence"], "--no-confidence: changes nothing with --drafter-kind eagle3"),
    (["--anchors-per-seq", 8], "--anchors-per-seq 8: changes nothing with --drafter-kind eagle3"),
    (["--target-layer-ids=-1,0"], "--target-layer-ids -1,0: strictly increasing layer ids from 0"),
    (["--ttt-length", 0], "--ttt-length"),
    (["--step-loss-decay", 0], "--step-loss-decay"),
    (["--drafter-kind", "dspark", "--ttt-length", 5], "--ttt-length 5: changes nothing with --drafter-kind dspark"),
    (["--ttt-length", 24], "--ttt-length 24: the chain unrolls within each --seq-len 24 sequence, so at most 23"),
])
def test_flags_that_do_not_apply_are_one_line_errors(tiny_target, tmp_path, capsys, flags, needle):
    """A DSpark flag with eagle3 (or an Eagle3 flag with dspark) would train the same drafter: refused in
    one line, before --out is made; so are the embeddings as a feature (DeepSpec's Eagle3 reads layers)."""
    ids = write_ids(tmp_path / "ids.jsonl", 2, 24, 64)
    argv = ["--drafter-kind", "eagle3", "--target", tiny_target.path, "--data-ids", ids, "--out", tmp_path / "o",
            "--steps", 1, "--seq-len", 24, *flags, "--no-progress"]
    rc = train.main([str(a) for a in argv])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and err[0].startswith("error: ") and needle in err[0], err
    assert not (tmp_path / "o").exists()


def test_a_one_layer_target_is_refused_by_name(tmp_path, capsys):
    """A 1-layer target has no decoder layer below its last for Eagle3 to read: the target is named, not
    the default --target-layer-ids the user never gave."""
    from drafters import make_target
    target = make_target(tmp_path / "t1", num_hidden_layers=1)
    ids = write_ids(tmp_path / "ids.jsonl", 2, 24, 48)
    capsys.readouterr()  # transformers' progress while saving the target
    argv = ["--drafter-kind", "eagle3", "--target", target, "--data-ids", ids, "--out", tmp_path / "o",
            "--steps", 1, "--seq-len", 24, "--device", "cpu", "--no-progress"]
    rc = train.main([str(a) for a in argv])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1, err
    assert err[0] == (f"error: --target {target}: 1 layer, too few for an Eagle3 drafter (it reads the "
                      "outputs of decoder layers below the last, so at least 2)"), err
    assert not (tmp_path / "o").exists()


def test_train_demo_sh_builds_the_eagle3_drafter(tmp_path):
    """scripts/train_demo.sh with DRAFTER_KIND=eagle3 (or both) trains DIR/eagle3 with train.py --drafter-kind
    eagle3 on the same data and settings, and moves it in (alone, or beside DIR/drafter); another kind is one
    line. The programs are test_demo.py's stand-ins, which also note their arguments here."""
    import os
    import subprocess

    from test_demo import FAKE_PYTHON

    bin_ = tmp_path / "bin"
    bin_.mkdir()
    fake = FAKE_PYTHON.replace("#!/usr/bin/env bash\n", '#!/usr/bin/env bash\necho "$*" >> "$ARGS_LOG"\n', 1)
    (bin_ / "python").write_text(fake)
    (bin_ / "python").chmod(0o755)
    script = str(REPO_ROOT / "scripts" / "train_demo.sh")

    def build(out, kind):
        log = tmp_path / f"args-{kind}.log"
        env = dict(os.environ, PATH=f"{bin_}{os.pathsep}{os.environ['PATH']}", TAG=kind, THREADS="1",
                   DRAFTER_KIND=kind, ARGS_LOG=str(log))
        p = subprocess.run(["bash", script, "--out", str(out)], capture_output=True, text=True, timeout=60, env=env)
        return p, log.read_text().splitlines() if log.exists() else []

    p, calls = build(tmp_path / "e", "eagle3")
    assert p.returncode == 0, p.stderr
    assert sorted(os.listdir(tmp_path / "e")) == ["corpus.json", "eagle3", "heldout.jsonl", "heldout.txt", "target"]
    trains = [c for c in calls if c.split()[0].endswith("/train.py")]
    assert len(trains) == 1 and "--drafter-kind eagle3" in trains[0] and "--ttt-length 7" in trains[0], calls
    for same in ("--seq-len 256", "--batch-size 8", "--lr 2e-3", "--seed 0"):
        assert same in trains[0], (same, trains[0])
    p, calls = build(tmp_path / "b", "both")
    assert p.returncode == 0 and {"drafter", "eagle3"} <= set(os.listdir(tmp_path / "b")), p.stderr
    assert len([c for c in calls if c.split()[0].endswith("/train.py")]) == 2
    p, calls = build(tmp_path / "x", "medusa")
    assert p.returncode == 2 and p.stderr.count("\n") == 1 and "DRAFTER_KIND=medusa" in p.stderr and not calls


def test_the_demo_eagle3_drafter_loads_and_decodes_losslessly():
    """demo/eagle3 (scripts/train_demo.sh, DRAFTER_KIND=eagle3: 600 steps on the demo drafter's data, stored
    in bfloat16) loads strictly beside demo/target and decodes two held-out prompts as the target alone."""
    import speculate

    demo = REPO_ROOT / "demo"
    target = checkpoint.load_target(str(demo / "target"))
    d = checkpoint.load_drafter(str(demo / "eagle3"), target)
    assert (d.cfg.layout, d.cfg.num_drafts, d.cfg.target_layer_ids) == ("eagle3", 7, (0, 1, 2))
    assert json.loads((demo / "eagle3" / "config.json").read_text())["torch_dtype"] == "bfloat16"
    prompts = [json.loads(line)["prompt_ids"] for line in (demo / "heldout.jsonl").read_text().splitlines()[:2]]
    spec = speculate.generate(speculate.load(str(demo / "target"), str(demo / "eagle3")), prompts, max_new_tokens=32,
                              temperature=0.0, ignore_eos=True)
    alone = speculate.generate(speculate.load(str(demo / "target")), prompts, max_new_tokens=32, temperature=0.0,
                               ignore_eos=True)
    assert [c.output_ids for c in spec] == [c.output_ids for c in alone]
    assert min(c.acceptance_length for c in spec) > 2.5, [c.acceptance_length for c in spec]
