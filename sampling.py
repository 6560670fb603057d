"""The probability math of a round, in plain torch: filtered softmax, sampling, the Markov chain that
drafts a block, and the acceptance rules that keep speculative decoding exact.

Sampling is the exponential race, argmax(p / E) with E ~ Exp(1): exact, and no host sync. A round's
noise is drawn outside compiled graphs (`Noise`), so a seed repeats a run token for token. These are
the references; kernels.py has Triton versions of the chain and of sampled acceptance.

Drafts are numbered as in the paper: x_1 .. x_K after the anchor x_0, draft x_k tested against the
target's p_{k-1}. Tensors count from 0: drafts[:, j] holds x_{j+1}, tested against p[:, j]."""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch


class Filters(NamedTuple):
    """After the temperature, in transformers' order: top-k (ties kept), top-p (the top token stays),
    min-p. Target and drafter are filtered alike, so speculative sampling stays exact."""
    top_k: int = 0       # 0: off
    top_p: float = 1.0   # 1.0: off
    min_p: float = 0.0   # 0.0: off

    @property
    def active(self) -> bool:
        return self.top_k > 0 or self.top_p < 1.0 or self.min_p > 0.0


NO_FILTERS = Filters()


def filter_logits(z: torch.Tensor, f: Filters) -> torch.Tensor:
    """z [..., V] (float32, already / T) -> z with -inf outside the kept set."""
    V = z.shape[-1]
    if 0 < f.top_k < V:
        largest = torch.topk(z, f.top_k, dim=-1).values
        kth = largest[..., -1:]  # [..., 1]
        z = z.masked_fill(z < kth, float("-inf"))
    if f.top_p < 1.0:
        # As transformers: ascending, drop what stays within 1 - p; never the largest.
        ordered, order = torch.sort(z, dim=-1, stable=True)
        p_ordered = torch.softmax(ordered, dim=-1)
        below = p_ordered.cumsum(dim=-1)  # the mass up to each token, smallest first
        drop_sorted = below <= 1 - f.top_p
        drop_sorted[..., -1] = False  # the largest always stays
        drop = torch.zeros_like(drop_sorted)
        drop = drop.scatter(-1, order, drop_sorted)  # the vocabulary's order
        z = z.masked_fill(drop, float("-inf"))
    if f.min_p > 0.0:
        p = torch.softmax(z, dim=-1)
        p_max = p.amax(dim=-1, keepdim=True)
        floor = f.min_p * p_max
        z = z.masked_fill(p < floor, float("-inf"))
    return z


def probs(logits: torch.Tensor, temperature: float, filters: Filters = NO_FILTERS) -> torch.Tensor:
    """softmax(logits / T) in float32 over the tokens the filters keep."""
    z = logits.float() / temperature
    z = filter_logits(z, filters)
    return torch.softmax(z, dim=-1)


def sample_from(p: torch.Tensor, noise: torch.Tensor):
    """One id per row of p [..., V]; noise ~ Exp(1) of p's shape."""
    race = p / noise  # the exponential race: argmax(p / E) is a draw from p
    return torch.argmax(race, dim=-1)


def sample(logits, temperature: float, noise, *, filters: Filters = NO_FILTERS):
    """argmax at T=0, else a draw from the filtered softmax(logits / T) raced against noise, Exp(1)
    of logits' shape (None at T=0)."""
    if temperature == 0:
        return torch.argmax(logits, dim=-1)
    p = probs(logits, temperature, filters)
    return sample_from(p, noise)


class Noise(NamedTuple):
    """All the randomness of one sampled round, in draw order (a row's shapes: `noise_shape`)."""
    # Exp(1) races of drafting: a chain's drafts [B, K, V]; a sampled tree's children [B, R, V]
    # (R = `tree_parent_count`)
    draft: torch.Tensor
    u: torch.Tensor      # uniforms of the acceptance tests: [B, K]; a tree's [B, N+1, N]
    bonus: torch.Tensor  # Exp(1): the correction / bonus race [B, V], a tree's too (`choose_at_nodes`)


def noise_shape(K: int, V: int, tree_budget: int = 0) -> Noise:
    """One row's shapes of a round's noise, as a `Noise` of shapes without the batch: a chain of K
    drafts, or a sampled tree of `tree_budget` nodes at most K deep."""
    if not tree_budget:
        return Noise(draft=(K, V), u=(K,), bonus=(V,))
    N = tree_budget
    R = tree_parent_count(N, K, V)
    return Noise(draft=(R, V), u=(N + 1, N), bonus=(V,))


def exponential(shape: tuple, generator, device) -> torch.Tensor:
    """Exp(1) draws (float32) as -log(U), U uniform in double precision: exact but for a 2^-53 chance
    of U = 0 (a race that cannot win); cheaper on a CPU than `Tensor.exponential_` (BENCHMARKS.md)."""
    u = torch.rand(shape, generator=generator, device=device, dtype=torch.float64)
    return u.log_().neg_().float()


def round_noise(generator, B: int, shape: Noise, device) -> Noise:
    """B rows' noise from one generator, in Noise's order (a row's draws depend on B: `rows_noise`
    gives each row its own)."""
    draft = exponential((B, *shape.draft), generator, device)
    u = torch.rand((B, *shape.u), generator=generator, device=device)
    bonus = exponential((B, *shape.bonus), generator, device)
    return Noise(draft, u, bonus)


def rows_noise(generators: list, shape: Noise, device) -> Noise:
    """Each row's noise from its request's generator (independent of its neighbours); free rows
    (generator None), whose tokens are thrown away, get placeholders."""
    rows = []
    for g in generators:
        if g is not None:
            rows.append(round_noise(g, 1, shape, device))
            continue
        draft = torch.ones((1, *shape.draft), device=device)
        u = torch.zeros((1, *shape.u), device=device)
        bonus = torch.ones((1, *shape.bonus), device=device)
        rows.append(Noise(draft, u, bonus))
    draft_races, uniforms, bonuses = zip(*rows)  # the rows' draft noise, u and bonus noise, apart
    draft = torch.cat(draft_races)
    u = torch.cat(uniforms)
    bonus = torch.cat(bonuses)
    return Noise(draft, u, bonus)


# Drafting: the Markov chain

def draw(z, j: int, temperature: float, filters: Filters, noise):
    """The chain's draft in column j (x_{j+1}) from logits z [B, V]: the argmax at T=0, else a sample
    from q = probs(z) with the chain's noise[:, j]. Returns the tokens [B] and q [B, V] (None at
    T=0)."""
    if temperature == 0:
        return torch.argmax(z, dim=-1), None
    q = probs(z, temperature, filters)
    noise_j = noise[:, j]
    return sample_from(q, noise_j), q


def stack_chain(drafts: list, qs: list):
    """A chain's columns stacked: drafts [B, K] and q [B, K, V] (None at T=0)."""
    tokens = torch.stack(drafts, 1)
    q = None
    if qs:
        q = torch.stack(qs, 1)
    return tokens, q


def markov_chain(base_logits, hidden, anchor, markov, temperature: float, noise, *,
                 filters: Filters = NO_FILTERS):
    """The sequential stage: z_k = U_k + b_k, with b_k from the head's `step(h_k, x_{k-1}, state)`
    (no head: DFlash, z_k = U_k). base_logits [B, K, V], hidden [B, K, H], anchor [B]; noise Exp(1)
    [B, K, V] (None at T=0). Returns drafts [B, K] and q [B, K, V], the distributions they were
    drawn from (None at T=0)."""
    drafts = []
    qs = []
    prev = anchor
    state = None
    for j in range(base_logits.shape[1]):  # column j drafts x_{j+1}
        z = base_logits[:, j]  # [B, V] U_{j+1}
        if markov is not None:
            h = hidden[:, j]  # [B, H]
            bias, state = markov.step(h, prev, state)
            z = z + bias
        token, q = draw(z, j, temperature, filters, noise)
        if q is not None:
            qs.append(q)
        drafts.append(token)
        prev = token  # what the next column conditions on
    return stack_chain(drafts, qs)


def eagle3_chain(drafter, h, anchor_pos, K: int, temperature: float, noise, *,
                 filters: Filters = NO_FILTERS):
    """Eagle3's drafting: x_k ~ softmax(lm_head(norm(h)) / T), then one step of its layer on (h, x_k)
    at position a + k - 1 gives the next h; h [B, H] starts as each row's carried state (the drafter's
    `carried`; anchor_pos [B] = a). Returns drafts [B, K] and q [B, K, V] (None at T=0), as
    `markov_chain`."""
    drafts = []
    qs = []
    for j in range(K):  # column j drafts x_{j+1}
        z = drafter.logits(h)  # [B, V]
        token, q = draw(z, j, temperature, filters, noise)
        if q is not None:
            qs.append(q)
        drafts.append(token)
        if j + 1 < K:  # the last draft's step would be read by nothing
            h = drafter.step(h, token, anchor_pos + j)  # x_{j+1} at position a + j
    return stack_chain(drafts, qs)


# Acceptance: the longest prefix of drafts the target keeps, then one token of its own

def prefix_length(ok: torch.Tensor) -> torch.Tensor:
    """[B, K] bool -> [B]: how many leading entries of each row are True."""
    leading = torch.cumprod(ok.long(), dim=1)  # 1 up to the first False, 0 from there
    return leading.sum(1)


def verified_mask(drafts, verify_len) -> torch.Tensor:
    """[B, K]: which drafts go to the target, drafts[:, j] where j < ℓ (x_1 .. x_ℓ)."""
    K = drafts.shape[1]
    positions = torch.arange(K, device=drafts.device)
    return positions < verify_len[:, None]


def residual(p, q):
    """normalize(max(p - q, 0)), the distribution after a rejection. It has no mass only where p = q,
    where nothing is rejected: p stands in there, never drawn from."""
    excess = torch.clamp(p - q, min=0)
    mass = excess.sum(dim=-1, keepdim=True)
    safe_mass = mass.clamp(min=1e-30)
    return torch.where(mass > 0, excess / safe_mass, p)


def accept_greedy(drafts, target_logits, verify_len):
    """Accept x_k while it is the target's argmax and k <= ℓ (verify_len [B]); target_logits
    [B, K+1, V]. Returns accepted n [B] and next_token [B], the token committed after them."""
    B, K = drafts.shape
    best = torch.argmax(target_logits, dim=-1)  # [B, K+1]
    agrees = drafts == best[:, :K]  # [B, K]
    verified = verified_mask(drafts, verify_len)
    ok = agrees & verified
    n = prefix_length(ok)
    batch = torch.arange(B, device=drafts.device)
    next_token = best[batch, n]  # [B] the target's argmax after the accepted drafts
    return n, next_token


def accept_sampled(drafts, q, target_logits, verify_len, temperature: float, u, noise, *,
                   filters: Filters = NO_FILTERS):
    """Rejection sampling: accept x_k if u_k·q_k(x_k) < p_{k-1}(x_k) and k <= ℓ; at the first
    rejection the correction from normalize(max(p - q, 0)), else the bonus from p_ℓ, raced with
    noise Exp(1) [B, V]; u [B, K] uniforms. Returns accepted n [B] and next_token [B], the token
    committed after them."""
    B, K = drafts.shape
    device = drafts.device
    p = probs(target_logits, temperature, filters)  # [B, K+1, V]
    n = torch.zeros(B, dtype=torch.long, device=device)
    final = p[:, 0]  # nothing drafted: the bonus from p_0
    if K:
        drafted = drafts[:, :, None]  # [B, K, 1]
        p_drafts = p[:, :K]  # [B, K, V] p_0 .. p_{K-1}, the target's at each draft
        p_x = p_drafts.gather(2, drafted)[:, :, 0]  # [B, K] p_{k-1}(x_k) in column k - 1
        q_x = q.gather(2, drafted)[:, :, 0]         # [B, K] q_k(x_k) in column k - 1
        passed = u * q_x < p_x  # the rejection test
        verified = verified_mask(drafts, verify_len)
        ok = passed & verified
        n = prefix_length(ok)
        batch = torch.arange(B, device=device)
        p_n = p[batch, n]  # [B, V] the target's distribution after the accepted drafts
        q_row = n.clamp(max=K - 1)  # n = K: nothing rejected, the residual unread
        q_next = q[batch, q_row]  # [B, V] q_{n+1}, the law of the draft rejected
        corrected = residual(p_n, q_next)
        rejected = n < verify_len
        final = torch.where(rejected[:, None], corrected, p_n)  # what the next token follows
    next_token = sample_from(final, noise)  # [B]
    return n, next_token


# Draft trees: the block's distributions grown into a tree of `budget` nodes, verified in one pass

class Tree(NamedTuple):
    """B draft trees of N = budget nodes after the root (node 0, the anchor), in the order they were
    chosen (best first: a parent before its children, siblings in the order they were drawn). A node
    the search never reached (too few candidates for the budget, or a path of probability 0) has
    parent -1 and is never followed; its token and depth are placeholders."""
    tokens: torch.Tensor   # [B, N+1]
    parents: torch.Tensor  # [B, N+1] the parent's node index; the root's (and an unused node's) is -1
    depths: torch.Tensor   # [B, N+1] the root's 0; node at depth d drafts the token at anchor + d
    # a sampled tree's [B, N+1, V]: the distribution each node's children were drawn from
    q: Optional[torch.Tensor] = None


def child_logits(base_logits, hidden, markov, depth: int, tokens, states):
    """The drafter's logits (float32) for the children, at `depth` (1-based), of M nodes a row at
    depth - 1 holding `tokens` [B, M], and the Markov state [B, M, S] they pass on (None when the
    head carries none); `states` is what the nodes' own parents passed them. [B, M, V], or
    [B, 1, V] without a Markov head: a position's distribution is then its own (DFlash), the same
    for every parent."""
    B, M = tokens.shape
    slot = depth - 1  # the block position drafting that depth
    z = base_logits[:, slot, None].float()  # [B, 1, V]
    state = None
    if markov is not None:
        h = hidden[:, slot, None].expand(B, M, -1)  # [B, M, H]: the Markov head runs on B * M rows
        flat_h = h.flatten(0, 1)
        flat_tokens = tokens.flatten()
        flat_states = None
        if states is not None:
            flat_states = states.flatten(0, 1)
        bias, state = markov.step(flat_h, flat_tokens, flat_states)
        bias = bias.float().unflatten(0, (B, M))
        z = z + bias
        if state is not None:
            state = state.unflatten(0, (B, M))
    return z, state


def tree_parent_count(budget: int, depth: int, V: int) -> int:
    """How many nodes `best_by_depth` draws children for: the root, then the nodes it keeps at each
    depth but the last (a sampled tree's races, one over the vocabulary for each)."""
    total = 0
    M = 1  # the nodes kept at the depth above: the root alone at first
    for d in range(1, min(depth, budget) + 1):
        total += M
        room = budget - d + 1
        M = min(room, M * min(room, V))
    return total


def best_by_depth(base_logits, hidden, anchor, markov, budget: int, tree_temperature: float, *,
                  temperature: float = 0.0, filters: Filters = NO_FILTERS, noise=None,
                  survival=None) -> dict:
    """`build_tree`'s search, a depth a step: of the children of the nodes kept at the depth above,
    the best are kept, as many as a tree of `budget` nodes can hold at that depth (budget - d + 1 at
    depth d, none past depth `budget`; all of them where fewer). Returns every kept node, depth by
    depth, as [B, C] each: tokens, scores, depths and parents; sampled, also "q" [B, 1 + C, V], the
    distribution each drew its children from (the root's first; zeros at the last depth). Kept nodes
    are numbered from 1, after the root's 0. Each parent offers as many of its likeliest children:
    a child outside them has as many better siblings, so it cannot be kept. With a Markov head a
    depth computes up to [B, budget, V] log-probabilities.

    Sampled (temperature > 0), a parent's children are drawn without replacement from q =
    probs(logits, temperature, filters), in the order of the race q / noise (noise [B, R, V] Exp(1),
    R = `tree_parent_count`, a row for each parent); its i-th child's score is still the i-th best
    log-probability at `tree_temperature`, whichever token was drawn, so whether a child is kept
    never depends on which token it holds (what keeps multi-draft rejection sampling exact). With
    `survival` (depth, parent_tokens [B, M]) -> c [B, M], the chance that a draft after each parent
    survives, the i-th child (from 0) scores log c + i log(1 - c) instead: the chance that the
    rejection rule keeps it, were each child kept with chance c."""
    B, L, V = base_logits.shape
    sampled = temperature > 0
    batch = torch.arange(B, device=anchor.device)[:, None]
    # The nodes kept at the depth being expanded, M a row: the root alone at first.
    tokens = anchor[:, None]  # [B, M]
    scores = torch.zeros(B, 1, device=anchor.device)
    states = None
    first = 0  # the number of the first of them (the root's 0)
    kept = {"tokens": [], "scores": [], "parents": [], "depths": []}  # each depth's, [B, M] each
    drawn_from = []  # sampled: each depth's parents' q, [B, M, V]
    deepest = min(L, budget)  # a node at depth d comes with its d - 1 ancestors
    for depth in range(1, deepest + 1):
        # ... so a tree of `budget` nodes holds at most budget - depth + 1 of this depth
        room = budget - depth + 1
        width = min(room, V)  # candidate children a node
        M = tokens.shape[1]
        z, state = child_logits(base_logits, hidden, markov, depth, tokens, states)  # [B, M or 1, V]
        ranks = torch.arange(width, device=anchor.device)
        # The i-th child's score, from its rank alone when sampled, never from the token it holds
        if sampled and survival is not None:
            survive = survival(depth, tokens)  # [B, M]
            c = survive.clamp(1e-6, 1 - 1e-6)[:, :, None]  # [B, M, 1]: log c, log(1 - c) finite
            top_logprobs = torch.log(c) + ranks * torch.log1p(-c)  # [B, M, width]
        else:  # the i-th best log-probability
            logprobs = torch.log_softmax(z / tree_temperature, dim=-1)
            top_logprobs, likeliest = torch.topk(logprobs, width, dim=-1)  # [B, M or 1, width]
        if sampled:  # the children: drawn without replacement from q
            q = probs(z, temperature, filters).expand(B, M, V)
            races = noise[:, first:first + M]  # [B, M, V] each parent's own (its row: its number)
            race = q / races
            top_tokens = torch.topk(race, width, dim=-1).indices  # drawn without replacement
            support = (q > 0).sum(dim=-1, keepdim=True)  # [B, M, 1] the tokens q can draw
            top_logprobs = top_logprobs.masked_fill(ranks >= support, float("-inf"))
            drawn_from.append(q)
        else:  # greedy: the likeliest children themselves
            top_tokens = likeliest  # [B, M or 1, width]
        child_scores = scores[:, :, None] + top_logprobs  # [B, M, width]
        candidate_scores = child_scores.flatten(1)  # parent by parent
        candidate_tokens = top_tokens.expand(B, M, width).flatten(1)
        order = torch.sort(candidate_scores, dim=1, descending=True, stable=True).indices
        best_first = order[:, :room]
        parent = best_first // width  # the parent's index among the nodes kept at the depth above
        tokens = candidate_tokens.gather(1, best_first)
        scores = candidate_scores.gather(1, best_first)
        if state is not None:
            states = state[batch, parent]  # each kept node's parent's
        kept["tokens"].append(tokens)
        kept["scores"].append(scores)
        kept["parents"].append(first + parent)
        kept["depths"].append(torch.full_like(tokens, depth))
        first = first + M
    every = {}
    for name, parts in kept.items():
        every[name] = torch.cat(parts, dim=1)
    if sampled:
        deepest_count = tokens.shape[1]  # the last depth's nodes draw no children
        leaves = base_logits.new_zeros((B, deepest_count, V), dtype=torch.float32)
        every["q"] = torch.cat(drawn_from + [leaves], dim=1)
    return every


def build_tree(base_logits, hidden, anchor, markov, budget: int, tree_temperature: float, *,
               temperature: float = 0.0, filters: Filters = NO_FILTERS, noise=None,
               survival=None) -> Tree:
    """The `budget` most likely continuations of each row's anchor, best first, as DDTree picks them:
    a node's score is the sum of its path's log-probabilities (at `tree_temperature`; DDTree's is 1).
    With a Markov head a child's distribution is conditioned on its parent's token (and the rnn
    head's state along its path); without one, on its depth alone. base_logits [B, L, V], hidden
    [B, L, H], anchor [B].

    DDTree grows the tree best first, a node a step. Scores only fall along a path, so its tree is
    the `budget` best nodes of all, and each of those has fewer than `budget` better nodes at its
    own depth, its parent among them (and fewer than budget - d + 1 at depth d: it comes with its
    d - 1 ancestors). So this grows it a depth a step, at most L steps whatever the budget: the
    children of the nodes kept at the depth above, of which the best are kept; then the `budget`
    best of all depths, best first. Of equal scores the shallower node comes first (so a
    parent precedes a child as likely as itself), then the earlier parent, then torch.topk's order
    among a parent's equally likely children (DDTree orders equal scores by the ranks from the root:
    the trees differ only there).

    Sampled (temperature > 0, with the race noise [B, R, V]), each node's children are drawn
    without replacement from its q instead of being its likeliest, and kept by rank, or by
    `survival` (`best_by_depth`); the tree carries every node's q for `choose_at_nodes`."""
    B = anchor.shape[0]
    N = budget
    every = best_by_depth(base_logits, hidden, anchor, markov, budget, tree_temperature,
                          temperature=temperature, filters=filters, noise=noise, survival=survival)
    C = every["scores"].shape[1]
    if C < N:  # too few candidates for the budget (a tiny vocabulary): placeholders, never reached
        placeholders = {"tokens": 0, "scores": float("-inf"), "parents": 0, "depths": 0, "q": 0.0}
        for name, fill in placeholders.items():
            if name not in every:
                continue
            shape = list(every[name].shape)
            shape[1] = N - C
            column = every[name].new_full(shape, fill)
            every[name] = torch.cat([every[name], column], dim=1)
    # The budget best of all depths. A parent is never worse than its child, and of equal scores the
    # stable sort keeps the shallower first: a chosen node's parent is chosen, and comes before it.
    scores = every["scores"]
    order = torch.sort(scores, dim=1, descending=True, stable=True).indices
    chosen = order[:, :N]  # [B, N] the tree's nodes after the root, as indices among the kept
    numbers = torch.arange(1, N + 1, device=anchor.device)  # the tree's nodes after the root
    numbers = numbers.expand(B, N)
    chosen_numbers = 1 + chosen  # [B, N] the chosen kept nodes' numbers (the root's 0)
    kept_count = every["parents"].shape[1]
    # A kept node's number (the root's 0) -> its index in the tree; only chosen nodes' parents, all
    # chosen, are looked up (the rest stay 0).
    node_of = anchor.new_zeros((B, 1 + kept_count))
    node_of.scatter_(1, chosen_numbers, numbers)
    chosen_parents = every["parents"].gather(1, chosen)  # their parents' numbers
    parent_node = node_of.gather(1, chosen_parents)
    reached = scores.gather(1, chosen) > float("-inf")
    parent_node = torch.where(reached, parent_node, -1)
    root = anchor[:, None]
    chosen_tokens = every["tokens"].gather(1, chosen)
    chosen_depths = every["depths"].gather(1, chosen)
    tree_tokens = torch.cat([root, chosen_tokens], dim=1)  # [B, N+1]
    no_parent = torch.full_like(root, -1)
    zero = torch.zeros_like(root)  # the root's depth, and its row of q
    tree_parents = torch.cat([no_parent, parent_node], dim=1)
    tree_depths = torch.cat([zero, chosen_depths], dim=1)
    tree_q = None
    if "q" in every:  # each node's q: the root's, then the chosen nodes' by their numbers
        q_rows = torch.cat([zero, chosen_numbers], dim=1)  # [B, N+1]
        batch = torch.arange(B, device=anchor.device)[:, None]
        tree_q = every["q"][batch, q_rows]
    return Tree(tree_tokens, tree_parents, tree_depths, tree_q)


def ancestors(tree: Tree, max_depth: int) -> torch.Tensor:
    """[B, N+1, N+1] bool: [b, i, j] is True where node j is node i or one of its ancestors (a tree at
    most `max_depth` deep)."""
    B, N1 = tree.parents.shape
    device = tree.parents.device
    itself = torch.eye(N1, dtype=torch.bool, device=device)
    seen = itself.expand(B, N1, N1).clone()
    up = tree.parents  # [B, N+1] each node's ancestor this many hops up (-1: past the root)
    for _ in range(max_depth):
        on_path = up >= 0
        index = up.clamp(min=0)
        is_ancestor = torch.nn.functional.one_hot(index, N1).bool()  # [B, N+1, N+1]
        seen |= is_ancestor & on_path[:, :, None]
        next_up = tree.parents.gather(1, index)  # that ancestor's parent
        up = torch.where(on_path, next_up, -1)
    return seen


def choose_at_nodes(tree: Tree, p, u, noise):
    """The token the walk takes at every node of a sampled tree: multi-draft rejection sampling
    (SpecInfer's, over children drawn without replacement as Sequoia verifies them). At a node with
    the target's p and children c_1 .. c_k, drawn in that order from q: accept c_i if
    u_i·q_i(c_i) < p_i(c_i); else p_{i+1} = normalize(max(p_i - q_i, 0)) and q_{i+1} is q_i without
    c_i, renormalized; every child rejected, a draw from p_{k+1}. The token follows p whatever k.
    p [B, N+1, V] the target's (filtered) distribution at each node; u [B, N+1, N] uniforms; noise
    [B, V] Exp(1), the final draw's race, one for all the nodes: a rejected child gets no mass in the
    residuals after it (its test failed, so p_i <= q_i there), so the walk stops at the first node
    where no child was accepted, and that node's final draw is the only one it takes; which node that
    is never depends on the race. Returns [B, N+1].

    The nodes are taken most children first: of N children in all, at most N // i nodes have an
    i-th, so the i-th children's step reads only that many rows of p and q, not N+1."""
    B, N1, V = p.shape
    N = N1 - 1
    device = p.device
    nodes = torch.arange(N1, device=device)
    is_child = tree.parents[:, None, :] == nodes[:, None]  # [B, parent, child]
    rank = is_child.long().cumsum(dim=-1) - 1  # a child's place among its siblings: the draw order
    counts = is_child.sum(dim=-1)  # [B, N+1] each node's children
    order = torch.argsort(counts, dim=1, descending=True, stable=True)  # most children first
    batch = torch.arange(B, device=device)[:, None]
    is_child = is_child[batch, order]
    rank = rank[batch, order]
    p = p[batch, order]  # copies: the steps below update them in place
    q = tree.q[batch, order]
    u = u[batch, order]
    chosen = torch.zeros((B, N1), dtype=torch.long, device=device)
    done = torch.zeros((B, N1), dtype=torch.bool, device=device)
    for i in range(N):  # the (i+1)-th child of every node at once
        m = N // (i + 1)  # the nodes that may have one come first
        p_i = p[:, :m]  # views of the first m rows: the updates below write them in place
        q_i = q[:, :m]
        chosen_i = chosen[:, :m]
        done_i = done[:, :m]
        u_i = u[:, :m, i]
        children_i = is_child[:, :m]
        rank_i = rank[:, :m]
        is_ith = children_i & (rank_i == i)
        testing = is_ith.any(dim=-1) & ~done_i  # [B, m] nodes with one, none accepted yet
        child = is_ith.long().argmax(dim=-1)  # [B, m] its node index (columns kept the tree's order)
        token = tree.tokens.gather(1, child)  # [B, m]
        drawn = token[:, :, None]
        p_x = p_i.gather(2, drawn)[:, :, 0]
        q_x = q_i.gather(2, drawn)[:, :, 0]
        passed = u_i * q_x < p_x  # the rejection test
        accept = testing & passed
        chosen_i.copy_(torch.where(accept, token, chosen_i))
        done_i |= accept
        rejected = testing & ~accept
        rejected = rejected[:, :, None]  # [B, m, 1]
        corrected = residual(p_i, q_i)
        without = q_i.scatter(2, drawn, 0.0)  # q_{i+1}: c_i cannot be drawn again
        left = without.sum(dim=-1, keepdim=True).clamp(min=1e-30)
        renormalized = without / left
        p_i.copy_(torch.where(rejected, corrected, p_i))
        q_i.copy_(torch.where(rejected, renormalized, q_i))
    from_residual = sample_from(p, noise[:, None, :])  # [B, N+1]: every node's, one race
    chosen_sorted = torch.where(done, chosen, from_residual)  # rows still most children first
    unsorted = torch.zeros_like(chosen)
    return unsorted.scatter(1, order, chosen_sorted)  # back in the nodes' order


def walk_tree(tree: Tree, target_tokens, max_depth: int):
    """From the root, follow the child holding the target's token at the current node; stop at the
    first node where none does (a tree at most `max_depth` deep). target_tokens [B, N+1]: the
    target's token at every node. Returns the path [B, max_depth+1] (node indices from the root;
    after the last accepted node, that node again), the accepted count n [B], and next_token [B],
    the target's token after the path."""
    B = tree.tokens.shape[0]
    device = tree.tokens.device
    batch = torch.arange(B, device=device)
    current = torch.zeros(B, dtype=torch.long, device=device)
    accepted = torch.zeros(B, dtype=torch.long, device=device)
    path = [current]
    for _ in range(max_depth):
        wanted = target_tokens[batch, current]  # [B]
        children = tree.parents == current[:, None]  # [B, N+1]
        holding = tree.tokens == wanted[:, None]
        match = children & holding
        found = match.any(dim=-1)
        child = match.long().argmax(dim=-1)
        current = torch.where(found, child, current)
        accepted = accepted + found.long()
        path.append(current)
    next_token = target_tokens[batch, current]  # [B]
    nodes = torch.stack(path, dim=1)
    return nodes, accepted, next_token
