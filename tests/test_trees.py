"""Draft trees (--tree-budget): built and walked as the plain-Python references say, DDTree's trees for a
DFlash drafter, lossless greedy and sampled, through continuous batching, recorded in the trace.

- sampling.build_tree / walk_tree (batched, on the device) equal build_tree_reference / walk_tree_reference
  (a heap and a loop, one row) on random drafters with every Markov head and without one.
- For a DFlash drafter the tree is DDTree's: the same nodes, parents and depths, and the same accepted
  path, as liranringel/ddtree's build_ddtree_tree and follow_verified_tree (commit c96427a) gave on the
  random logits in tests/golden/ddtree_trees.json (made by running that code; cases with exact ties
  are left out: DDTree orders equal logits as torch.topk does and breaks equal scores by rank path).
- Greedy output equals the target's with trees of several budgets, batched with rows that finish and
  rows refilled; sampled output follows the target's law (chi-square, with filters too).
"""

from __future__ import annotations

import heapq
import json
import math
import os

import pytest
import torch
from conftest import REPO_ROOT, chi2_pvalue
from drafters import make_drafter, make_eagle3, make_target
from test_generate import filtered_joint
from test_generate import flags as sampling_flags
from test_lossless import PROMPTS, SAMPLE_PROMPT, SV, M, check_trace, run_traced, seq_index, target_logits_after

import sampling
from drafter import MARKOV_HEADS, RNNMarkov
from sampling import Filters

torch.set_num_threads(1)
DDTREE = REPO_ROOT / "tests" / "golden" / "ddtree_trees.json"
HEADS = {"none": None, **MARKOV_HEADS}


# ----------------------------------------------------------------------------------------
# The fast path against the references

def build_tree_reference(children, budget: int, depth: int) -> list[tuple[int, int]]:
    """One row's tree in plain Python, the reference `sampling.build_tree` is tested against: a heap
    of candidates (score, path of ranks), each pop adding a node and pushing its next sibling and
    its first child. children(tokens) -> (the best min(budget, V) tokens after the path `tokens`,
    their log-probabilities, finite), best first. Returns the nodes in order as (token, parent).
    Equal scores go to the smaller ranks from the root, as in DDTree."""
    if budget <= 0 or depth <= 0:
        return []
    nodes = []   # (token, parent node index; 0 is the root)
    paths = [[]]  # each node's tokens from the root
    options = [children([])]  # each node's candidate children: (tokens, scores)
    _, first_scores = options[0]
    heap = [(-first_scores[0], (0,), 0, 0)]  # (-score, ranks, parent, rank)
    while heap and len(nodes) < budget:
        negative, ranks, parent, rank = heapq.heappop(heap)
        score = -negative
        tokens, scores = options[parent]
        token = tokens[rank]
        nodes.append((token, parent))
        me = len(nodes)
        path = paths[parent] + [token]
        paths.append(path)
        sibling_rank = rank + 1
        if sibling_rank < len(tokens):  # the next sibling
            sibling = score - scores[rank] + scores[sibling_rank]
            sibling_ranks = ranks[:-1] + (sibling_rank,)
            heapq.heappush(heap, (-sibling, sibling_ranks, parent, sibling_rank))
        if len(path) < depth:  # the first child
            child_tokens, child_scores = children(path)
            options.append((child_tokens, child_scores))
            child = score + child_scores[0]
            child_ranks = ranks + (0,)
            heapq.heappush(heap, (-child, child_ranks, me, 0))
        else:
            options.append(([], []))
    return nodes


def choose_reference(p: list[float], q: list[float], children: list[int], u: list[float],
                     race: list[float]) -> tuple[int, bool]:
    """One node's multi-draft rejection sampling in plain Python, the reference
    `sampling.choose_at_nodes` is tested against: the node's target p and draft q over the
    vocabulary, its children's tokens in the order they were drawn, a uniform for each, and the
    final draw's race. Returns the token and whether a child was accepted."""
    for child, u_i in zip(children, u):
        if u_i * q[child] < p[child]:
            return child, True
        excess = [max(a - b, 0.0) for a, b in zip(p, q)]
        mass = sum(excess)
        if mass > 0:
            p = [e / mass for e in excess]
        q = list(q)
        q[child] = 0.0
        left = sum(q)
        if left > 0:
            q = [x / left for x in q]
    raced = [a / e for a, e in zip(p, race)]  # the exponential race: its argmax is a draw from p
    return raced.index(max(raced)), False


def walk_tree_reference(nodes: list[tuple[int, int]],
                        target_tokens: list[int]) -> tuple[list[int], int]:
    """One row's walk in plain Python, the reference `sampling.walk_tree` is tested against: from
    the root, the child holding the target's token at the current node, until none does. Returns
    the path (node indices, the root's 0 first) and the target's token after it."""
    path = [0]
    while True:
        current = path[-1]
        wanted = target_tokens[current]
        child = None
        for i, (token, parent) in enumerate(nodes):
            if parent == current and token == wanted:
                child = i + 1
                break
        if child is None:
            return path, wanted
        path.append(child)


def path_logits(base_logits, hidden, anchor, markov, path):
    """One row's drafter logits [1, V] for the token after `path` (the tokens after the anchor): the
    chain rule through the Markov head."""
    state = None
    prev = torch.tensor([anchor])
    for d, token in enumerate(path + [None]):
        z = base_logits[None, d].float()
        if markov is not None:
            bias, state = markov.step(hidden[None, d], prev, state)
            z = z + bias.float()
        if token is None:
            return z
        prev = torch.tensor([token])


def reference_children(base_logits, hidden, anchor, markov, k, temperature=1.0):
    """children(path) for build_tree_reference: the k likeliest tokens after the path."""
    def children(path):
        z = path_logits(base_logits, hidden, anchor, markov, path)
        logprobs = torch.log_softmax(z / temperature, dim=-1)[0]
        best, ids = torch.topk(logprobs, k)
        return ids.tolist(), best.tolist()
    return children


def drafter_outputs(B, L, V, H, r, head):
    """A block drafter's round, random: base logits [B, L, V], hidden states [B, L, H], anchors [B],
    and a Markov head of rank r (None for "none")."""
    base = 2 * torch.randn(B, L, V)
    hidden = torch.randn(B, L, H)
    anchor = torch.randint(0, V, (B,))
    markov = None if HEADS[head] is None else HEADS[head](H, V, r)
    return base, hidden, anchor, markov


def as_nodes(tree: sampling.Tree, row: int) -> list[tuple[int, int]]:
    parents = tree.parents[row, 1:].tolist()
    tokens = tree.tokens[row, 1:].tolist()
    return [(t, p) for t, p in zip(tokens, parents) if p >= 0]


@pytest.mark.parametrize("head", list(HEADS))
@pytest.mark.parametrize("budget", [1, 3, 8, 20])
def test_build_and_walk_equal_the_references(head, budget):
    torch.manual_seed(budget)
    B, L, V, H, r = 3, 4, 11, 8, 5
    base, hidden, anchor, markov = drafter_outputs(B, L, V, H, r, head)
    if markov is not None:
        torch.nn.init.normal_(markov.markov_w2.weight, std=2.0)
    with torch.no_grad():
        tree = sampling.build_tree(base, hidden, anchor, markov, budget, tree_temperature=0.7)
        for b in range(B):
            children = reference_children(base[b], hidden[b], int(anchor[b]), markov, min(budget, V), 0.7)
            want = build_tree_reference(children, budget, L)
            assert as_nodes(tree, b) == want, (b, as_nodes(tree, b), want)
            depths = [0]
            for _, parent in want:
                depths.append(depths[parent] + 1)
            assert tree.depths[b, :len(depths)].tolist() == depths
        # The walk, on target tokens that follow the tree for a while and then leave it.
        chosen = torch.randint(0, V, (B, budget + 1))
        for b in range(B):
            nodes = as_nodes(tree, b)
            for i, (token, parent) in enumerate(nodes):
                if torch.rand(()) < 0.8:
                    chosen[b, parent] = token
        path, accepted, following = sampling.walk_tree(tree, chosen, L)
        for b in range(B):
            want_path, want_next = walk_tree_reference(as_nodes(tree, b), chosen[b].tolist())
            n = len(want_path) - 1
            assert int(accepted[b]) == n and path[b, :n + 1].tolist() == want_path
            assert path[b, n + 1:].tolist() == [want_path[-1]] * (L - n) and int(following[b]) == want_next


@pytest.mark.parametrize("head", ["none", "rnn"])
def test_a_budget_past_every_candidate_leaves_the_rest_unreached(head):
    """A vocabulary of 3 and 2 positions hold 12 nodes; a budget of 20 reaches those and no more."""
    torch.manual_seed(7)
    B, L, V, H, r, budget = 2, 2, 3, 8, 5, 20
    base, hidden, anchor, markov = drafter_outputs(B, L, V, H, r, head)
    with torch.no_grad():
        tree = sampling.build_tree(base, hidden, anchor, markov, budget, tree_temperature=1.0)
        for b in range(B):
            children = reference_children(base[b], hidden[b], int(anchor[b]), markov, V)
            want = build_tree_reference(children, budget, L)
            assert len(want) == V + V * V
            assert as_nodes(tree, b) == want
            assert tree.parents[b, len(want) + 1:].tolist() == [-1] * (budget - len(want))


def test_the_compiled_build_does_not_grow_with_the_budget():
    """The build goes a depth a step: its graph is as large at 32 nodes as at 4 (one a node would grow
    with them, and so would its compile)."""
    B, L, V, H, r = 2, 4, 64, 8, 5
    base = torch.randn(B, L, V)
    hidden = torch.randn(B, L, H)
    anchor = torch.randint(0, V, (B,))
    markov = RNNMarkov(H, V, r)
    sizes = {}
    for budget in (4, 32):
        counted = []

        def counting(graph_module, example_inputs):
            counted.append(len(graph_module.graph.nodes))
            return graph_module.forward

        torch._dynamo.reset()
        build = torch.compile(sampling.build_tree, backend=counting, fullgraph=True, dynamic=False)
        with torch.no_grad():
            tree = build(base, hidden, anchor, markov, budget, 0.7)
            want = sampling.build_tree(base, hidden, anchor, markov, budget, 0.7)
        assert tree.q is None and want.q is None  # not sampled
        assert all(torch.equal(a, b) for a, b in zip(tree[:3], want[:3]))
        sizes[budget] = sum(counted)
    torch._dynamo.reset()
    assert sizes[4] == sizes[32], sizes


def test_ancestors_of_a_hand_built_tree():
    #      0
    #    1   2
    #    3     4
    #    5
    parents = torch.tensor([[-1, 0, 0, 1, 2, 3, -1]])
    tree = sampling.Tree(torch.zeros(1, 7, dtype=torch.long), parents, torch.tensor([[0, 1, 1, 2, 2, 3, 0]]))
    seen = sampling.ancestors(tree, 3)[0]
    assert seen[5].nonzero().flatten().tolist() == [0, 1, 3, 5]
    assert seen[4].nonzero().flatten().tolist() == [0, 2, 4]
    assert seen[6].nonzero().flatten().tolist() == [6]  # a node the search never reached sees itself


def ddtree_cases():
    fixture = json.loads(DDTREE.read_text())
    for case in fixture["cases"]:
        if case["flags"]["topk_ties"] or case["flags"]["score_ties"]:
            continue
        yield pytest.param(case, fixture["logits_den"], id=case["id"])


@pytest.mark.parametrize("case,den", list(ddtree_cases()))
def test_a_dflash_tree_is_ddtrees(case, den):
    logits = torch.tensor(case["logits_num"], dtype=torch.float32).reshape(case["depth"], case["vocab"]) / den
    L, budget = case["depth"], case["budget"]
    if budget <= 0 or L == 0:
        pytest.skip("DDTree's tree is the root alone; a budget of 0 is the chain here")
    untempered = 1.0  # DDTree ranks by the drafter's own distributions
    tree = sampling.build_tree(logits[None], torch.zeros(1, L, 1), torch.tensor([0]), None, budget,
                               untempered)
    want = case["expected"]
    n = len(want["node_tokens"])
    assert tree.tokens[0, 1:n + 1].tolist() == want["node_tokens"]
    assert tree.parents[0, :n + 1].tolist() == want["parents"]
    assert tree.depths[0, 1:n + 1].tolist() == want["node_depths"]
    assert (tree.parents[0, n + 1:] == -1).all()  # DDTree's heap ran dry there too
    for walk in case["walks"]:
        chosen = torch.zeros(1, budget + 1, dtype=torch.long)
        chosen[0, :len(walk["target_tokens"])] = torch.tensor(walk["target_tokens"])
        path, accepted, following = sampling.walk_tree(tree, chosen, L)
        assert path[0, :len(walk["accepted"])].tolist() == walk["accepted"]
        assert int(accepted[0]) == len(walk["accepted"]) - 1 and int(following[0]) == walk["next_token"]


# ----------------------------------------------------------------------------------------
# Sampled trees: children drawn without replacement, multi-draft rejection sampling at each node

def sampled_children(base_logits, hidden, anchor, markov, k, tree_temperature, temperature, f, race,
                     survival=None):
    """children(path) for build_tree_reference when every parent draws with the same race [V]: its
    children are the race's order over q, scored by rank (the best log-probabilities at
    tree_temperature, or with `survival` log c + i log(1 - c); none past q's support). Also returns
    q(path), the distribution drawn from."""
    def logits(path):
        return path_logits(base_logits, hidden, anchor, markov, path)

    def q_of(path):
        return sampling.probs(logits(path), temperature, f)[0]

    def children(path):
        q = q_of(path)
        drawn = torch.topk(q / race, k).indices.tolist()
        scores = torch.topk(torch.log_softmax(logits(path)[0] / tree_temperature, -1), k).values.tolist()
        if survival is not None:
            parent = (path or [anchor])[-1]
            c = float(survival(len(path) + 1, torch.tensor([[parent]]))[0, 0].clamp(1e-6, 1 - 1e-6))
            scores = [math.log(c) + i * math.log1p(-c) for i in range(k)]
        support = int((q > 0).sum())
        return drawn[:support], scores[:support]
    return children, q_of


@pytest.mark.parametrize("head", ["none", "vanilla", "rnn"])
@pytest.mark.parametrize("budget,f", [(3, Filters()), (8, Filters(4, 0.9)), (20, Filters())])
@pytest.mark.parametrize("shape", ["rank", "survival"])
def test_a_sampled_build_equals_the_heap_on_its_draws(head, budget, f, shape):
    """With one race for every parent, each node's children are that race's order over its q, kept
    by rank (or by a survival chance per depth and parent token): the heap on those children gives
    the same tree, and each node carries its q."""
    torch.manual_seed(budget)
    B, L, V, H, r = 2, 4, 11, 8, 5
    base, hidden, anchor, markov = drafter_outputs(B, L, V, H, r, head)
    R = sampling.tree_parent_count(budget, L, V)
    race = torch.empty(B, V).exponential_(1)
    noise = race[:, None].expand(B, R, V)
    chances = torch.rand(B, L + 1, V)  # a survival chance for each row, depth and parent token

    def survival_of(rows: slice):
        if shape == "rank":
            return None
        return lambda depth, parents: chances[rows, depth].gather(1, parents)  # parents [B, M]
    with torch.no_grad():
        tree = sampling.build_tree(base, hidden, anchor, markov, budget, 0.7, temperature=0.9, filters=f,
                                   noise=noise, survival=survival_of(slice(None)))
        for b in range(B):
            children, q_of = sampled_children(base[b], hidden[b], int(anchor[b]), markov, min(budget, V), 0.7,
                                              0.9, f, race[b], survival_of(slice(b, b + 1)))
            want = build_tree_reference(children, budget, L)
            assert as_nodes(tree, b) == want
            paths = [[]]
            for token, parent in want:
                paths.append(paths[parent] + [token])
            for node, path in enumerate(paths):
                if len(path) < min(L, budget):  # the deepest nodes draw no children
                    torch.testing.assert_close(tree.q[b, node], q_of(path))


@pytest.mark.parametrize("budget,L,V", [(1, 4, 11), (5, 3, 7), (16, 7, 50), (20, 2, 3), (64, 7, 4096)])
def test_a_sampled_build_reads_one_race_for_each_parent(budget, L, V):
    """tree_parent_count counts the parents the build draws children for: the rows of noise it reads."""
    base = torch.randn(1, L, V)
    with torch.no_grad():
        every = sampling.best_by_depth(base, None, torch.tensor([0]), None, budget, 1.0, temperature=1.0,
                                       noise=torch.ones(1, sampling.tree_parent_count(budget, L, V), V))
    deepest = int(every["depths"].max())
    leaves = int((every["depths"] == deepest).sum())
    assert every["q"].shape[1] - leaves == sampling.tree_parent_count(budget, L, V)


def test_each_parent_draws_its_children_from_its_own_race():
    """Node n's children come from row n of the noise (the root's row 0, then the nodes by number): with
    every q the same, each row's race makes a different three tokens the likeliest, and each node's
    children are among its own row's three."""
    V, L, budget = 16, 2, 3
    base = torch.zeros(1, L, V)  # q uniform at both depths, for every parent (no Markov head)
    rows = sampling.tree_parent_count(budget, L, V)  # the root and the 3 nodes of depth 1
    noise = torch.ones(1, rows, V)
    favourites = {}
    for row in range(rows):
        three = (4 * row, 4 * row + 1, 4 * row + 2)
        for rank, token in enumerate(three):
            noise[0, row, token] = 1e-3 * (rank + 1)  # q / race: the first of the three, then ...
        favourites[row] = three
    with torch.no_grad():
        every = sampling.best_by_depth(base, None, torch.tensor([5]), None, budget, 1.0, temperature=1.0,
                                       noise=noise)
    tokens = every["tokens"][0].tolist()
    parents = every["parents"][0].tolist()
    depths = every["depths"][0].tolist()
    assert depths == [1, 1, 1, 2, 2]
    for token, parent in zip(tokens, parents):
        assert token in favourites[parent], (token, parent, favourites[parent])


def random_sampled_tree(B, V, budget, seed):
    torch.manual_seed(seed)
    L, H, r = 3, 8, 5
    base = torch.randn(B, L, V, dtype=torch.float64)
    markov = MARKOV_HEADS["vanilla"](H, V, r).double()
    hidden = torch.randn(B, L, H, dtype=torch.float64)
    anchor = torch.randint(0, V, (B,))
    R = sampling.tree_parent_count(budget, L, V)
    noise = torch.empty(B, R, V, dtype=torch.float64).exponential_(1)
    with torch.no_grad():
        return sampling.build_tree(base, hidden, anchor, markov, budget, 1.0, temperature=1.0, noise=noise)


@pytest.mark.parametrize("budget", [1, 4, 12, 24])
def test_choose_at_nodes_equals_the_reference(budget):
    B, V = 4, 9
    tree = random_sampled_tree(B, V, budget, seed=budget)
    p = torch.softmax(2 * torch.randn(B, budget + 1, V, dtype=torch.float64), -1)
    p[0, 0, :3] = 0  # a target that cannot draw some of what the drafter can
    p[0, 0] /= p[0, 0].sum()
    u = torch.rand(B, budget + 1, budget, dtype=torch.float64)
    race = torch.empty(B, V, dtype=torch.float64).exponential_(1)  # one final race for all the nodes
    chosen = sampling.choose_at_nodes(tree, p, u, race)
    for b in range(B):
        for node in range(budget + 1):
            children = [int(t) for t, parent in zip(tree.tokens[b], tree.parents[b]) if parent == node]
            want, accepted = choose_reference(p[b, node].tolist(), tree.q[b, node].tolist(), children,
                                              u[b, node].tolist(), race[b].tolist())
            assert int(chosen[b, node]) == want, (b, node, children)
            # what lets the nodes share one final race: the walk stops where no child was accepted
            assert accepted or want not in children, (b, node, children)


def one_node_draws(p, q, k, n, sort_children=False):
    """n draws of choose_at_nodes at a root with k children drawn from q without replacement."""
    V = p.shape[0]
    race = torch.empty(n, V, dtype=torch.float64).exponential_(1)
    children = torch.topk(q / race, k, dim=-1).indices  # [n, k] each root's draws, in order
    if sort_children:  # the likeliest first, whatever was drawn: what the rule must not be given
        children = children.gather(1, torch.argsort(q[children], dim=1, descending=True))
    root = torch.zeros(n, 1, dtype=torch.long)
    tree = sampling.Tree(tokens=torch.cat([root, children], 1),
                         parents=torch.cat([torch.full((n, 1), -1), torch.zeros(n, k, dtype=torch.long)], 1),
                         depths=torch.cat([root, torch.ones(n, k, dtype=torch.long)], 1),
                         q=q.expand(n, k + 1, V))
    u = torch.rand(n, k + 1, k, dtype=torch.float64)
    final = torch.empty(n, V, dtype=torch.float64).exponential_(1)
    return sampling.choose_at_nodes(tree, p.expand(n, k + 1, V), u, final)[:, 0]


@pytest.mark.parametrize("k", [1, 2, 3, 5])
def test_multi_draft_rejection_sampling_draws_from_the_target(k):
    """Whatever the number of children, the token a node gives follows p (chi-square over 60,000 draws),
    with p and q far apart and p zero where q is not."""
    torch.manual_seed(k)
    n = 60000
    p = torch.tensor([0.0, 0.05, 0.1, 0.15, 0.3, 0.4], dtype=torch.float64)
    q = torch.tensor([0.35, 0.25, 0.2, 0.1, 0.06, 0.04], dtype=torch.float64)
    assert chi2_pvalue(one_node_draws(p, q, k, n), p) > 1e-3
    if k > 1:  # the check has power: the same children, tested likeliest first, are caught
        biased = one_node_draws(p, q, k, n, sort_children=True)
        assert chi2_pvalue(biased, p) < 1e-3


# ----------------------------------------------------------------------------------------
# Decoding with trees

@pytest.fixture(scope="module")
def tenv(tmp_path_factory):
    d = tmp_path_factory.mktemp("trees")
    target = make_target(d / "target", attn_scale=0.01)
    drafters = {"vanilla": make_drafter(d / "vanilla", target, block_size=4, oracle=True, oracle_scale=4.0,
                                        norm_scale=0.05),
                "rnn": make_drafter(d / "rnn", target, markov="rnn", block_size=4, oracle=True, oracle_scale=4.0,
                                    norm_scale=0.05),
                "zlab": make_drafter(d / "zlab", target, spelling="zlab", markov=None, confidence=False,
                                     block_size=5)}
    prompts = d / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt_ids": p}) + "\n" for p in PROMPTS))
    V = json.load(open(os.path.join(target, "config.json")))["vocab_size"]
    return dict(dir=str(d), target=target, drafters=drafters, prompts=str(prompts), V=V)


def decode(env, *extra, drafter=None):
    args = ["--target", env["target"], "--prompts-file", env["prompts"], "--max-new-tokens", 24, *extra]
    if drafter is not None:
        args += ["--drafter", env["drafters"][drafter]]
    return run_traced(env["dir"], args)


@pytest.mark.parametrize("drafter", ["vanilla", "rnn", "zlab"])
def test_greedy_trees_are_lossless_through_continuous_batching(tenv, drafter):
    want = decode(tenv, "--batch-size", 1).outputs()
    depth = 4
    for budget, batch in ((2, 3), (6, 1), (12, 3)):
        tr = decode(tenv, "--tree-budget", budget, "--tree-temperature", 1.0, "--batch-size", batch, drafter=drafter)
        assert tr.outputs() == want, (budget, batch)
        for r in tr.rounds:
            assert len(r["draft"]) == len(r["parents"]) == budget and r["confidence"] is None
            assert r["accepted"] == len(r["path"]) <= r["depth"] <= depth
            assert 1 <= r["verified"] <= budget
            # The path is a chain of parent and child in the tree, from the root.
            parent = 0
            for node in r["path"]:
                assert r["parents"][node - 1] == parent
                parent = node
        if drafter != "zlab":  # (the z-lab drafter's weights are random: rarely right)
            deep = [r for r in tr.rounds if r["accepted"] >= 2]
            assert deep, "the oracle drafter's trees should be walked deep at times"


def test_the_walk_takes_a_branch_the_chain_would_not(tenv):
    """A tree accepts more than the chain where the chain's first draft is wrong and a sibling is right."""
    chain = decode(tenv, "--batch-size", 2, drafter="vanilla")
    tree = decode(tenv, "--batch-size", 2, "--tree-budget", 16, "--tree-temperature", 1.0, drafter="vanilla")
    assert tree.outputs() == chain.outputs()
    branched = [r for r in tree.rounds if r["path"] and r["path"][0] != 1]  # left the best child at once
    assert branched, "no round followed a sibling of the best first draft"
    tau_chain = sum(r["accepted"] + 1 for r in chain.rounds) / len(chain.rounds)
    tau_tree = sum(r["accepted"] + 1 for r in tree.rounds) / len(tree.rounds)
    assert tau_tree > tau_chain


# vanilla and rnn drafters have a confidence head, which shapes their sampled trees; "ranked" is a
# vanilla drafter without one (ranked at --tree-temperature), as is zlab (no Markov head either)
SAMPLED = [("vanilla", 1.0, Filters(), 4), ("vanilla", 0.8, Filters(5, 0.8, 0.05), 4), ("zlab", 1.0, Filters(), 4),
           ("rnn", 1.0, Filters(), 9), ("ranked", 1.0, Filters(), 6)]  # rnn drafts 3 deep: the joint in a round


@pytest.mark.parametrize("drafter,temperature,f,budget", SAMPLED,
                         ids=[f"{d}-T{t}-{f}-{b}" for d, t, f, b in SAMPLED])
def test_sampled_trees_follow_the_targets_law(tmp_path_factory, drafter, temperature, f, budget):
    d = tmp_path_factory.mktemp("trees_sampled")
    target = make_target(d / "target", vocab_size=SV, attn_scale=0.05)
    if drafter == "zlab":
        path = make_drafter(d / "d", target, spelling="zlab", markov=None, confidence=False, block_size=3)
    elif drafter == "rnn":
        path = make_drafter(d / "d", target, markov="rnn", oracle=True, oracle_scale=1.0, norm_scale=0.05,
                            block_size=3)
    elif drafter == "ranked":
        path = make_drafter(d / "d", target, oracle=True, oracle_scale=1.0, norm_scale=0.05, block_size=2,
                            confidence=False)
    else:
        path = make_drafter(d / "d", target, oracle=True, oracle_scale=1.0, norm_scale=0.05, block_size=2)
    prefixes, logits = target_logits_after(target, SAMPLE_PROMPT, M, SV)
    env = dict(dir=str(d), target=target, prefixes=prefixes, logits=logits)
    n = 6000
    tr = run_traced(d, ["--target", target, "--drafter", path, "--prompt-ids", ",".join(map(str, SAMPLE_PROMPT)),
                        "--num-samples", n, "--batch-size", n, "--max-new-tokens", M, "--tree-budget", budget,
                        *sampling_flags(temperature, f)])
    outs = tr.outputs()
    assert all(len(o) == M for o in outs)
    p = chi2_pvalue(seq_index(outs, SV), filtered_joint(env, temperature, f))
    assert p > 1e-3, f"chi-square p = {p:.2e}"
    first = [r["accepted"] for r in tr.rounds if r["round"] == 0]
    assert first.count(0) > 50 and sum(1 for a in first if a >= 2) > 50  # the walk stopped early and went deep


def test_a_biased_walk_fails_the_same_check(tmp_path_factory, monkeypatch):
    """The check has power: a walk that takes the best child whatever the target drew is caught."""
    d = tmp_path_factory.mktemp("trees_biased")
    target = make_target(d / "target", vocab_size=SV, attn_scale=0.05)
    path = make_drafter(d / "d", target, oracle=True, oracle_scale=1.0, norm_scale=0.05, block_size=2)
    prefixes, logits = target_logits_after(target, SAMPLE_PROMPT, M, SV)
    env = dict(dir=str(d), target=target, prefixes=prefixes, logits=logits)
    real = sampling.walk_tree

    def greedy_walk(tree, chosen, depth):
        best_child = tree.tokens[:, 1:2].expand_as(chosen)  # node 1: the root's best child
        chosen = torch.where(torch.arange(chosen.shape[1]) == 0, best_child, chosen)
        return real(tree, chosen, depth)
    monkeypatch.setattr(sampling, "walk_tree", greedy_walk)
    n = 6000
    tr = run_traced(d, ["--target", target, "--drafter", path, "--prompt-ids", ",".join(map(str, SAMPLE_PROMPT)),
                        "--num-samples", n, "--batch-size", n, "--max-new-tokens", M, "--tree-budget", 4,
                        "--temperature", 1.0])
    assert chi2_pvalue(seq_index(tr.outputs(), SV), filtered_joint(env, 1.0, Filters())) < 1e-3


@pytest.mark.parametrize("flags,needle", [
    (["--tree-budget", 4], "--tree-budget 4: a tree is drafted by a --drafter"),
    (["--tree-budget", 4, "--confidence-threshold", 0.5], "--tree-budget 4: a draft tree is verified whole"),
    (["--tree-budget", -1], "--tree-budget: invalid value -1"),
    (["--tree-budget", 4, "--temperature", 1, "--tree-temperature", 0.5],
     "--tree-temperature 0.5: a sampled tree from a drafter with a confidence head is shaped by the head"),
])
def test_trees_refuse_what_they_cannot_do(tenv, capsys, flags, needle):
    import speculate

    drafter = [] if flags == ["--tree-budget", 4] else ["--drafter", tenv["drafters"]["vanilla"]]
    rc = speculate.main([str(a) for a in ["--target", tenv["target"], "--prompt-ids", "1,2", *drafter, *flags]])
    err = capsys.readouterr().err
    assert rc == 2 and needle in err and len(err.strip().splitlines()) == 1, err


@pytest.mark.parametrize("drafter,temperature", [("zlab", 1), ("vanilla", 0)])
def test_tree_temperature_is_taken_where_it_ranks_the_tree(tenv, drafter, temperature, monkeypatch):
    """Sampled without a confidence head, or greedy, --tree-temperature ranks the branches: every tree the
    run builds is built at it."""
    import sampling

    built_at = []
    real = sampling.build_tree

    def build_tree(base_logits, hidden, anchor, markov, N, tree_temperature, **kw):
        built_at.append(tree_temperature)
        return real(base_logits, hidden, anchor, markov, N, tree_temperature, **kw)

    monkeypatch.setattr(sampling, "build_tree", build_tree)
    tr = decode(tenv, "--tree-budget", 4, "--temperature", temperature, "--tree-temperature", 0.5,
                drafter=drafter)
    assert tr.rounds and built_at and set(built_at) == {0.5}


def test_tree_temperature_is_refused_only_where_it_ranks_no_tree(tenv):
    """With drafters with and without a confidence head (eval.py's rows), --tree-temperature ranks the
    second's sampled trees: taken; with only the first, refused. An engine built for the first alone
    (one of eval.py's rows) is not refused: the check is the run's, made once at its edge."""
    from types import SimpleNamespace

    import speculate
    from support import flags
    from support.cli import UserError

    s = flags.Settings(tree_budget=4, tree_temperature=0.5)
    head, no_head = SimpleNamespace(confidence_head=object()), SimpleNamespace(confidence_head=None)
    flags.check_tree_temperature(s, [head, no_head], 1.0)
    flags.check_tree_temperature(s, [head], 0.0)  # greedy: ranked
    with pytest.raises(UserError, match="--tree-temperature 0.5: a sampled tree"):
        flags.check_tree_temperature(s, [head], 1.0)
    m = speculate.load(tenv["target"], tenv["drafters"]["vanilla"])
    with pytest.raises(UserError, match="--tree-temperature 0.5: a sampled tree"):
        speculate.generate(m, [[1, 2]], max_new_tokens=2, temperature=1.0, tree_budget=4, tree_temperature=0.5)
    settings = flags.check_settings(flags.Settings(max_new_tokens=2, temperature=1.0, tree_budget=4,
                                                   tree_temperature=0.5), "cpu")
    speculate.make_engine(m, m.drafter, [[1, 2]], settings, verbose=False)



@pytest.mark.parametrize("drafter,kw,needle", [
    ("eagle3", dict(tree_budget=4), "--tree-budget 4: an Eagle3 drafter drafts a chain of one-token steps"),
    ("eagle3", dict(tree_budget=2, temperature=1.0), "--tree-budget 2: an Eagle3 drafter drafts a chain"),
    (None, dict(tree_budget=4), "--tree-budget 4: a tree is drafted by a drafter, and this engine has none"),
    ("vanilla", dict(tree_budget=-3), "--tree-budget: invalid value -3 (valid: 0 to 1024)"),
    ("vanilla", dict(tree_budget=4.5), "--tree-budget: invalid value 4.5 (expected an integer)"),
    ("vanilla", dict(tree_budget=True), "--tree-budget: invalid value True (expected an integer)"),
    ("vanilla", dict(tree_budget=4, tree_temperature=0.0), "--tree-temperature: invalid value 0.0 (valid: "),
    ("vanilla", dict(tree_temperature=-1.0), "--tree-temperature: invalid value -1.0 (valid: "),
    ("vanilla", dict(tree_budget=4, scheduler="threshold", threshold=0.5),
     "--tree-budget 4: a draft tree is verified whole, and --scheduler threshold chooses"),
])
def test_an_engine_built_by_hand_checks_its_tree(tenv, tmp_path, drafter, kw, needle):
    """Engine's tree arguments are checked as their flags are, when it is built: an Eagle3 drafter (or none)
    drafted a chain that the round read with a tree's widths (wrong greedy tokens, or an IndexError), a
    budget that is no count failed inside torch, and a tree temperature of 0 ranked every node NaN."""
    import speculate
    from support.cli import UserError

    paths = {"eagle3": make_eagle3(tmp_path / "e3", tenv["target"]), "vanilla": tenv["drafters"]["vanilla"],
             None: None}
    m = speculate.load(tenv["target"], paths[drafter])
    with pytest.raises(UserError) as e:
        speculate.Engine(m.target, m.drafter, batch_size=1, max_seq=64, **kw)
    assert str(e.value).startswith(needle) and "\n" not in str(e.value), str(e.value)
    # what the flags take is taken: a block drafter's tree, and a chain at another tree temperature (an
    # eval.py row beside trees), an Eagle3 drafter's chain among them
    m = speculate.load(tenv["target"], tenv["drafters"]["vanilla"])
    speculate.Engine(m.target, m.drafter, batch_size=1, max_seq=64, tree_budget=4, tree_temperature=1.0)
    speculate.Engine(m.target, m.drafter, batch_size=1, max_seq=64, tree_temperature=1.0)
    m = speculate.load(tenv["target"], paths["eagle3"])
    speculate.Engine(m.target, m.drafter, batch_size=1, max_seq=64, tree_temperature=1.0)

def test_a_trees_survival_is_the_chains_confidence_at_that_position(tenv):
    """tree_survival scores a tree's nodes at one depth as the chain's confidence at that position
    (its calibrated temperature included), each after its own parent token."""
    import speculate
    from support.checkpoint import load_drafter, load_target

    target = load_target(tenv["target"])
    d = load_drafter(tenv["drafters"]["vanilla"], target)
    K = d.cfg.num_drafts
    d.calibrate([0.5 + k for k in range(K)])
    torch.manual_seed(0)
    B, H = 3, d.cfg.layers.hidden_size
    hidden = torch.randn(B, K, H)
    previous = torch.randint(0, tenv["V"], (B, K))
    with torch.no_grad():
        chain = d.confidence(hidden, previous)  # [B, K]
        for depth in range(1, K + 1):
            parent_tokens = previous[:, depth - 1:depth]  # [B, 1] the chain's token before that depth
            tree = speculate.tree_survival(d, hidden, depth, parent_tokens)
            torch.testing.assert_close(tree[:, 0], chain[:, depth - 1])


def test_calibration_is_taken_where_the_head_shapes_a_sampled_tree(tenv, tmp_path, capsys):
    """A sampled tree's branches are ranked by the confidence head, which --calibration scales: taken, and it
    changes the trees; a greedy tree's are not (refused on the command line, as an unscheduled chain is; in
    generate, whose models carry the file for every call, left unread)."""
    import speculate

    cal = tmp_path / "sts.json"
    cal.write_text(json.dumps({"temperatures": [0.05] * 4}))
    sampled = ["--tree-budget", 6, "--temperature", 1, "--seed", 3]
    plain = decode(tenv, *sampled, drafter="vanilla")
    calibrated = decode(tenv, *sampled, "--calibration", cal, drafter="vanilla")
    shapes = [[r["parents"] for r in tr.rounds] for tr in (plain, calibrated)]
    assert shapes[0] != shapes[1]
    base = ["--target", tenv["target"], "--drafter", tenv["drafters"]["vanilla"], "--prompt-ids", "1,2",
            "--calibration", cal]
    for extra, needle in ((["--tree-budget", 4, "--temperature", 0], "a greedy draft tree ranks its branches"),
                          (["--temperature", 1], "only a scheduled round (--scheduler")):
        rc = speculate.main([str(a) for a in base + extra])
        err = capsys.readouterr().err.strip()
        assert rc == 2 and len(err.splitlines()) == 1 and needle in err, err
    # In the API the calibration is the loaded models': a call that reads no confidence leaves it unread,
    # so the unscheduled baseline runs on the same models (the same tokens as without the file).
    m = speculate.load(tenv["target"], tenv["drafters"]["vanilla"], calibration=str(cal))
    plain = speculate.load(tenv["target"], tenv["drafters"]["vanilla"])
    speculate.generate(m, [[1, 2]], max_new_tokens=4, temperature=1.0, tree_budget=4)
    for kw in (dict(tree_budget=4, temperature=0), dict(temperature=1.0), dict()):
        [done] = speculate.generate(m, [[1, 2]], max_new_tokens=4, **kw)
        [expected] = speculate.generate(plain, [[1, 2]], max_new_tokens=4, **kw)
        assert done.output_ids == expected.output_ids
    speculate.generate(m, [[1, 2]], max_new_tokens=4, temperature=1.0, confidence_threshold=0.5)


def test_calibration_read_by_nothing_says_that_a_reader_needs_a_confidence_head(tenv, tmp_path, capsys):
    """--calibration with neither a schedule nor a sampled tree is refused before the models load; the
    line says that either needs a drafter with a confidence head, as a head-less drafter (z-lab's DFlash
    here; Eagle3 alike) would refuse the remedies it named, in speculate.py and eval.py alike."""
    import eval as ev
    import speculate

    cal = tmp_path / "sts.json"
    cal.write_text(json.dumps({"temperatures": [1.0] * 5}))
    headless = tenv["drafters"]["zlab"]
    said = (f"error: --calibration {cal}: only a scheduled round (--scheduler threshold, hardware, async) or "
            "a sampled draft tree reads the confidences, each of a --drafter with a confidence head (an Eagle3 "
            "or DFlash drafter has none); without either it changes nothing")
    rc = speculate.main([str(a) for a in ["--target", tenv["target"], "--drafter", headless, "--prompt-ids", "1,2",
                                          "--max-new-tokens", 4, "--temperature", 1, "--calibration", cal]])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and err == [said], err
    data = tmp_path / "data"
    data.mkdir()
    (data / "ids.jsonl").write_text(json.dumps({"prompt_ids": [1, 2]}) + "\n")
    rc = ev.main([str(a) for a in ["--target", tenv["target"], "--drafter", headless, "--data-dir", data,
                                   "--datasets", "ids", "--max-new-tokens", 4, "--no-progress",
                                   "--calibration", cal, "--out", tmp_path / "r.json"]])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and err == [said], err


@pytest.mark.parametrize("temperature", [0, 1])
def test_a_trees_round_counts_against_free_memory(tenv, capsys, monkeypatch, temperature):
    """What a tree's round holds over the vocabulary (the target's logits at its nodes; sampled, its races
    and distributions) is added to the KV caches' need before decoding, and said, greedy or sampled."""
    import speculate
    from support import flags

    monkeypatch.setattr(flags, "free_memory", lambda device: 10_000)  # bytes: too little for anything
    rc = speculate.main([str(a) for a in ["--target", tenv["target"], "--drafter", tenv["drafters"]["vanilla"],
                                          "--prompt-ids", "1,2", "--tree-budget", 4, "--temperature", temperature]])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1 and "the KV caches for --batch-size 1" in err, err
    assert "a tree's logits and distributions over the vocabulary" in err
    assert err.endswith("--tree-budget")


def test_check_trace_accepts_tree_rounds(tenv):
    tr = decode(tenv, "--batch-size", 3, "--tree-budget", 5, drafter="vanilla")
    check_trace(tr, n_requests=len(PROMPTS), K=4, V=tenv["V"], confidence=False, max_new=24, tree_budget=5)


def test_a_stop_token_on_the_path_ends_the_round_there_in_the_counts():
    """metrics counts a tree round by its path's tokens: an accepted stop token ends what it accepted and
    committed, and the positions it counts, as a chain's does; its verified stays the nodes the target scored
    (it became the path's depth, so a tree's #propose mixed two units)."""
    from types import SimpleNamespace

    from support import metrics

    rd = {"draft": [5, 9, 3, 7], "parents": [0, 0, 2, 3], "path": [2, 3, 4], "accepted": 3, "verified": 4,
          "depth": 3}
    assert metrics.accepted_tokens(rd) == [9, 3, 7]
    assert metrics.round_counts(rd, {3}) == (2, 4, 2)
    assert metrics.round_counts(rd, {5}) == (3, 4, 4)  # 5 is a node off the path
    c = metrics.count([SimpleNamespace(output_ids=[9, 3], rounds=[rd])], K=4, stop_ids={3})
    assert (c["accepted"], c["verified"], c["committed"]) == (2, 4, 2)
    assert c["verified_at"] == c["tried"] == [1, 1, 0, 0] and c["accepted_at"] == [1, 1, 0, 0]


def test_a_tree_counts_as_verified_the_nodes_its_search_reached(tenv):
    """Sampled under --top-k 1 a node has one child the target could take, so a budget past the tree's
    depth leaves nodes unreached: a round's `verified` counts the nodes reached, not the budget."""
    tr = decode(tenv, "--tree-budget", 12, "--temperature", 1, "--top-k", 1, drafter="zlab")
    reached = [sum(p >= 0 for p in r["parents"]) for r in tr.rounds]
    assert [r["verified"] for r in tr.rounds] == reached
    assert min(reached) < 12, reached
