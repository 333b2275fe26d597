"""The workflow-aware policy's order (kvstore/policy/workflow.py) and its predictor, on its own books: retired
blocks first (fewest touching workflows first), then active blocks by lookahead score, LRU without hints, pinned
blocks never; the transition model's lookahead and accuracy."""
from __future__ import annotations

from kvstore.policy.workflow import WorkflowPolicy
from kvstore.workflows import Touch, Workflows
from kvstore.workflows.popularity import level_of
from kvstore.workflows.predictor import END, Gaps, TransitionModel, survival


def k(i: int) -> bytes:
    return i.to_bytes(4, "big")


def drain(pol: WorkflowPolicy) -> list[int]:
    out = []
    while (v := pol.victim(0)) is not None:
        pol.removed(v)
        out.append(int.from_bytes(v, "big"))
    return out


def test_without_hints_it_is_lru_and_pins_are_never_victims() -> None:
    pol = WorkflowPolicy(Workflows())
    for i in range(6):
        pol.added(k(i), 0)
    pol.accessed(k(0))
    pol.pinned(k(2))
    assert drain(pol) == [1, 3, 4, 5, 0]
    pol.unpinned(k(2))
    assert drain(pol) == [2]


def test_retired_blocks_go_first_fewest_touching_workflows_first() -> None:
    flows = Workflows()
    pol = WorkflowPolicy(flows)
    for wid in ("a", "b", "c"):
        flows.call(wid, "planner", "t")
    pol.added(k(0), 0, Touch("a", "planner"))      # touched by a and b: shared
    pol.accessed(k(0), Touch("b", "planner"))
    pol.added(k(1), 0, Touch("a", "planner"))      # a's own
    pol.added(k(2), 0, Touch("c", "planner"))      # c's own: c stays active
    pol.added(k(3), 0)                             # no hint: retired, touched by none
    flows.end("a")
    flows.end("b")
    assert pol.counts() == {"retired": 3, "active": 1, "workflows": 1}
    assert drain(pol) == [3, 1, 0, 2]


def test_active_blocks_of_the_workflow_likeliest_to_end_go_first() -> None:
    flows = Workflows()
    pol = WorkflowPolicy(flows)
    for i in range(20):                             # learned: after "last" a workflow ends, after "first" it goes on
        flows.call(f"old{i}", "first", "t")
        flows.call(f"old{i}", "last", "t")
        flows.end(f"old{i}")
    flows.call("x", "first", "t")
    flows.call("y", "first", "t")
    flows.call("y", "last", "t")
    pol.added(k(0), 0, Touch("x", "first"))
    pol.added(k(1), 0, Touch("y", "last"))
    assert flows.value("y") < flows.value("x")
    assert drain(pol) == [1, 0]


def test_the_tag_budget_keeps_the_most_recent_workflows() -> None:
    flows = Workflows()
    pol = WorkflowPolicy(flows, tag_budget=2)
    for wid in "abc":
        flows.call(wid, "agent")
    pol.added(k(0), 0, Touch("a"))
    pol.accessed(k(0), Touch("b"))
    pol.accessed(k(0), Touch("c"))
    assert list(pol.tags[k(0)]) == ["b", "c"] and pol.touched[k(0)] == 3
    flows.end("b")
    flows.end("c")
    assert pol.counts()["retired"] == 1            # a, still active, fell out of the budget


def test_the_transition_model_looks_ahead_and_scores_itself() -> None:
    m = TransitionModel()
    for _ in range(10):
        m.called("w", "code", "<start>", "coder")
        m.called("w", "code", "coder", "tester")
        m.called("w", "code", "tester", "coder")     # a retry loop, then the end
        m.called("w", "code", "coder", "tester")
        m.ended("w", "code", "tester")
    ahead = m.lookahead("code", "coder", 3)
    assert ahead[0] == {"tester": 1.0}
    assert ahead[1] == {END: 0.5, "coder": 0.5}                  # tester: back to the coder, or done
    assert survival(ahead)[0] == 1.0 and survival(ahead)[1] == 0.5
    assert m.accuracy.rate(1) is not None and m.accuracy.rate(1) > 0.5
    assert m.lookahead("unknown", "agent", 2) == [{"agent": 1.0}, {"agent": 1.0}]    # unseen: it goes on


def test_retiring_one_workflow_moves_its_blocks_and_teaches_no_end() -> None:
    flows = Workflows()
    pol = WorkflowPolicy(flows)
    flows.call("a", "coder", "t")
    flows.call("b", "coder", "t")
    pol.added(k(0), 0, Touch("a", "coder"))
    pol.added(k(1), 0, Touch("b", "coder"))
    assert flows.retire("a") and not flows.retire("a")
    assert pol.counts() == {"retired": 1, "active": 1, "workflows": 1}
    assert flows.predictor.next_of("t", "coder") == {}          # no END learned
    assert drain(pol) == [0, 1]


def test_gaps_give_the_expected_residual_wait() -> None:
    gaps = Gaps(keep=0)                           # (never forgets: every gap weighs the same, the figures exact)
    assert gaps.residual("t", "a", 0.0) is None and gaps.mean is None
    for g in range(1, 11):                        # 1..10 s after agent a of type t
        gaps.observe("t", "a", float(g))
    assert gaps.residual("t", "a", 0.0) == 5.5
    assert gaps.residual("t", "a", 5.0) == 3.0   # E[G - 5 | G > 5] over 6..10
    assert gaps.residual("t", "a", 12.0) == 7.5  # past every gap seen: the mean, plus how far past the largest
    assert gaps.residual("t", "other", 5.0) == 3.0   # an agent not seen: its type's gaps
    assert gaps.residual("u", "a", 0.0) is None


def test_gaps_forget_with_a_window_and_see_a_heavy_tail() -> None:
    """The distribution follows the traffic (an effective window of `keep` gaps), and a heavy tail seen often
    enough says a workflow that waited long will wait longer still (issue 34: tool waits)."""
    gaps = Gaps(keep=100)
    for _ in range(1000):
        gaps.observe("t", "a", 1.0)
    for _ in range(1000):
        gaps.observe("t", "a", 3.0)               # the traffic changed: ten windows later, 1 s is forgotten
    assert abs(gaps.residual("t", "a", 0.0) - 3.0) < 1e-3
    tail = Gaps()
    for i in range(1000):                         # 90% answer in 1 s, 10% take 100 s
        tail.observe("t", "tool", 100.0 if i % 10 == 0 else 1.0)
    soon, waited = tail.residual("t", "tool", 0.0), tail.residual("t", "tool", 2.0)
    assert soon is not None and waited is not None and soon < 11.0 < 97.0 < waited


def test_timed_the_workflow_that_just_called_goes_first() -> None:
    """Gaps of ~10 s learned: a workflow that called 9 s ago is due in ~1 s, one that called 1 s ago in ~9 s: the
    latter's blocks go first (untimed, the two are worth the same and LRU decides: the former's, older, go first)."""
    for timed, first in ((True, "b"), (False, "a")):
        now = [0.0]
        flows = Workflows(clock=lambda now=now: now[0], timed=timed)   # type: ignore[misc]
        pol = WorkflowPolicy(flows)
        for _ in range(5):                        # teach the gaps: type t calls every 10 s
            flows.call("teach", "x", "t")
            now[0] += 10.0
        flows.end("teach")
        flows.call("a", "x", "t")
        pol.added(k(1), 0, Touch("a", "x"))
        now[0] += 8.0
        flows.call("b", "x", "t")
        pol.added(k(2), 0, Touch("b", "x"))
        now[0] += 1.0
        p_a, due_a = flows.expect("a")
        p_b, due_b = flows.expect("b")
        assert p_a == p_b and due_a is not None and due_b is not None and due_a < due_b
        assert drain(pol)[0] == (1 if first == "a" else 2), timed


def test_a_put_is_not_admitted_over_blocks_worth_more() -> None:
    flows = Workflows(timed=False)
    pol = WorkflowPolicy(flows)
    for wid in ("a", "b", "n"):
        flows.call(wid, "x", "t")
    pol.added(k(0), 0, Touch("a", "x"))
    pol.accessed(k(0), Touch("b", "x"))           # two live workflows' prefix: worth two
    pol.added(k(1), 0, Touch("a", "x"))           # a's own: worth one
    pol.added(k(2), 0)                            # no hint: retired
    assert pol.admits(k(2), Touch("n", "x"))
    assert not pol.admits(k(0), Touch("n", "x"))  # worth two against one
    assert pol.admits(k(1), Touch("n", "x"))      # worth as much: evicted, as LRU would
    assert pol.admits(k(1), Touch("gone", "x"))   # no live workflow: no opinion


def test_one_shot_workflows_without_ends_do_not_freeze_the_pool() -> None:
    """Workflows of one call each whose ends never come, and no gaps learned: all worth the same, so a new one's
    blocks may evict the oldest one's (LRU among equals), not find every block worth more."""
    flows = Workflows()
    pol = WorkflowPolicy(flows)
    for i in range(4):
        flows.call(f"w{i}", "x", "t")
        pol.added(k(i), 0, Touch(f"w{i}", "x"))
    flows.call("new", "x", "t")
    assert pol.victim(0) == k(0) and pol.admits(k(0), Touch("new", "x"))


def test_a_block_workflows_to_come_reuse_outlives_an_idle_workflows_own() -> None:
    """Issue 34: shared blocks (a document, a system prompt) are reused by workflows that have not begun, which no
    lookahead sees. Workflows of type t each read doc block 0 once and end; while no block was ever reused by a
    second workflow, a retired block goes first (PBKV's order); once new workflows keep reusing the doc, the retired
    doc (touched by many) is worth more than the own block of an active workflow due back only much later."""
    now = [0.0]
    flows = Workflows(clock=lambda: now[0])
    pol = WorkflowPolicy(flows)
    flows.call("slow", "x", "t")
    pol.added(k(1), 0, Touch("slow", "x"))       # the active workflow's own block
    flows.call("w0", "x", "t")
    pol.added(k(0), 0, Touch("w0", "x"))         # the doc, stored by the first reader
    flows.end("w0")
    assert pol.victim(0) == k(0)                 # nothing measured yet: retired first
    for i in range(1, 30):                        # a new reader every second, each gone after two calls
        now[0] += 0.5
        flows.call(f"w{i}", "x", "t")
        now[0] += 0.5
        flows.call(f"w{i}", "x", "t")             # (gaps of 0.5 s: the mean gap, and so the time scale)
        pol.accessed(k(0), Touch(f"w{i}", "x"))
        flows.end(f"w{i}")
    assert pol.counts()["retired"] == 1 and pol.pop.rate(1) > 0
    assert pol.victim(0) == k(1)                 # "slow" called 30 s ago, gaps 0.5 s: due back last


def test_a_block_every_workflow_reads_outranks_one_four_read() -> None:
    """Levels go on past the tag budget (popularity.level_of): a prompt block every workflow reads and document
    blocks four workflows read, then no one, were one level (4) with one rate, and the least recent went first: the
    prompt. Now the prompt sits at the top level, whose rate its readers measured, and the documents go first."""
    now = [0.0]
    flows = Workflows(clock=lambda: now[0])
    pol = WorkflowPolicy(flows)                  # tag budget 4
    for i in range(30):                          # a new workflow every second reads the prompt, calls twice, ends
        w = f"w{i}"
        now[0] += 0.5
        flows.call(w, "x", "t")
        blocks = [0, 10, 11, 12] if i < 4 else [0]     # the first four read the documents too
        for b in blocks:
            if i == 0:
                pol.added(k(b), 0, Touch(w, "x"))
            else:
                pol.accessed(k(b), Touch(w, "x"))
        now[0] += 0.5
        flows.call(w, "x", "t")
        flows.end(w)
    for d in (10, 11, 12):                       # the documents read again (no hint): more recent than the prompt
        pol.accessed(k(d))
    assert pol.describe(k(0))["touched"] == 30 and pol.describe(k(10))["touched"] == 4   # type: ignore[index]
    assert pol.pop.rate(level_of(30, 4)) > pol.pop.rate(4)
    assert drain(pol) == [10, 11, 12, 0]


def test_a_put_of_the_missed_blocks_keeps_the_prefix_it_read() -> None:
    """Namespace.put saves only the blocks its request missed: the head it read (0, 1) is not evicted for them and,
    once the tail is stored, is refreshed tail first, so eviction takes the tail (3, 2) before the head — as after
    a whole-chain save. (Before: the head, read first, went before the tail stored after it.)"""
    flows = Workflows(timed=False)
    pol = WorkflowPolicy(flows)
    flows.call("a", "x", "t")
    pol.added(k(1), 0, Touch("a", "x"))
    pol.added(k(0), 0, Touch("a", "x"))          # the prefix 0, 1 (head most recent)
    flows.call("a", "x", "t")                     # the next call reads it ...
    for i in (0, 1):
        pol.pinned(k(i))
        pol.accessed(k(i), Touch("a", "x"))
    for i in (1, 0):
        pol.unpinned(k(i))
    assert not pol.admits(k(1), Touch("a", "x"))  # ... and its put stops rather than evict what it read
    pol.added(k(3), 0, Touch("a", "x"))          # ... then stores the rest, tail first
    pol.added(k(2), 0, Touch("a", "x"))
    assert drain(pol) == [3, 2, 1, 0]


def test_an_evicted_blocks_touch_count_comes_back_with_it() -> None:
    """Issue 34: a block three workflows touched keeps its level when evicted and stored again (before, it came back
    touched by one, among the first to go): a fourth workflow storing it makes it four; its last toucher storing its
    own block again adds no new reuse (three); stored without a hint it comes back at three, and then outlives a
    block one workflow touched, retired before it."""
    flows = Workflows()
    pol = WorkflowPolicy(flows)
    for wid in ("a", "b", "c", "d", "e"):
        flows.call(wid, "x", "t")
    pol.added(k(0), 0, Touch("a", "x"))
    pol.accessed(k(0), Touch("b", "x"))
    pol.accessed(k(0), Touch("c", "x"))
    for touch, touched in ((Touch("d", "x"), 4), (Touch("d", "x"), 4), (None, 4), (Touch("e", "x"), 5)):
        pol.removed(k(0))
        assert pol.describe(k(0)) is None
        pol.added(k(0), 0, touch)
        assert pol.describe(k(0))["touched"] == touched      # type: ignore[index]
    pol.added(k(1), 0, Touch("a", "x"))
    for wid in ("a", "b", "c", "d", "e"):
        flows.end(wid)
    assert drain(pol) == [1, 0]                               # retired: the fewest-touched first


def test_what_is_remembered_of_evicted_blocks_is_bounded() -> None:
    """The memory of evicted blocks is a bounded history (kvstore.policy.levels.History, FACTOR records per block
    held, at least MIN_RECORDS): the oldest evictions are forgotten first; blocks no hint named are not recorded."""
    from kvstore.policy.levels import MIN_RECORDS

    flows = Workflows()
    pol = WorkflowPolicy(flows)
    pol.added(k(10**6), 0)                                    # no hint: nothing to remember
    pol.removed(k(10**6))
    assert pol.evicted.history is None
    flows.call("a", "x", "t")
    n = 3 * MIN_RECORDS
    for i in range(n):
        pol.added(k(i), 0, Touch("a", "x"))
        pol.removed(k(i))
    assert pol.evicted.remembered <= MIN_RECORDS < n                 # nothing held: the least history
    flows.call("b", "x", "t")
    pol.added(k(0), 0, Touch("b", "x"))                      # the first eviction: forgotten
    pol.added(k(n - 1), 0, Touch("b", "x"))                  # the last: a's count comes back, b's added
    assert [pol.describe(k(i))["touched"] for i in (0, n - 1)] == [1, 2]   # type: ignore[index]


def test_a_type_whose_calls_never_reread_their_blocks_is_worth_only_what_they_are_to_others() -> None:
    """Issue 34 (kvstore.workflows.reuse): a static pipeline whose stages each begin with their own role prompt
    never rereads what it stored, so its lookahead is worth nothing to its own blocks; a chat rereads its history
    every turn and keeps its value. Until MIN_STORED blocks are counted a type keeps the convention (its value)."""
    from kvstore.workflows.reuse import MIN_STORED

    flows = Workflows(timed=False)
    pol = WorkflowPolicy(flows)
    n = 0
    for i in range(int(MIN_STORED) // 2 + 8):                   # two blocks each a later call could reread
        for stage in ("extract", "format"):
            flows.call(f"p{i}", stage, "pipe")
            if i == 0 and stage == "extract":
                assert flows.value("p0") > 0                     # nothing counted yet: the convention
            for _ in range(2):                                    # a stage's own blocks, never read again
                pol.added(k(n), 0, Touch(f"p{i}", stage))
                n += 1
        chat = [k(10_000 + 10 * i + j) for j in range(3)]
        for turn in range(2):
            flows.call(f"c{i}", "chat", "chat")
            for key in chat[:turn + 1]:
                if key in pol.where:
                    pol.accessed(key, Touch(f"c{i}", "chat"))   # the history so far, reread
                else:
                    pol.added(key, 0, Touch(f"c{i}", "chat"))
        flows.end(f"p{i}")
        flows.end(f"c{i}")
    flows.call("p-live", "extract", "pipe")
    flows.call("c-live", "chat", "chat")
    assert flows.value("p-live") == 0.0 and flows.value("c-live") > 0
    flows.self_reuse = False                                      # the convention: worth its lookahead
    flows.call("p-other", "extract", "pipe")
    assert flows.value("p-other") > 0


def test_a_block_left_out_enters_at_the_level_its_askers_give_it() -> None:
    """Issue 34: blocks a put left out (`refused`) are remembered as touched by its workflow, once per workflow: a
    block two workflows were refused comes in at level 3 for a third, at 2 for the last of them asking again."""
    flows = Workflows()
    pol = WorkflowPolicy(flows)
    for wid in ("a", "b", "c"):
        flows.call(wid, "x", "t")
    pol.refused([k(0)], 0, Touch("a", "x"))
    pol.refused([k(0)], 0, Touch("b", "x"))
    pol.refused([k(0)], 0, Touch("b", "x"))                      # b again: still two workflows
    assert pol.describe(k(0)) is None
    assert [pol.evicted.coming_level(k(0), Touch(w, "x"), 4) for w in ("c", "b")] == [3, 2]
    assert pol.evicted.coming_level(None, Touch("c", "x"), 4) == 1
    pol.added(k(0), 0, Touch("c", "x"))
    assert pol.describe(k(0))["touched"] == 3                    # type: ignore[index]


def _map_reduce(flows: Workflows, pol: WorkflowPolicy, wid: str, base: int, reduce: bool = True) -> None:
    """A planner's prompt (2 blocks), a worker's (2 blocks) read by its check, the planner's reread by a reducer."""
    flows.call(wid, "planner", "mr")
    for j in range(2):
        pol.added(k(base + j), 0, Touch(wid, "planner"))
    flows.call(wid, "worker", "mr")
    for j in range(2, 4):
        pol.added(k(base + j), 0, Touch(wid, "worker"))
    flows.call(wid, "worker", "mr")                                 # the check: the worker's prompt, once more
    for j in range(2, 4):
        pol.accessed(k(base + j), Touch(wid, "worker"))
    if reduce:
        flows.call(wid, "reducer", "mr")
        for j in range(2):
            pol.accessed(k(base + j), Touch(wid, "reducer"))


def test_blocks_a_workflow_is_done_with_go_before_its_older_prefix() -> None:
    """Issue 34: a worker's prompt read by its check is never read again by its workflow (learned from ended ones),
    while the planner's older prefix waits for the reducer: the worker's go first, though used more recently;
    without the rereads' books (`dead_blocks` off) the order is the group's LRU, the planner's prefix first."""
    for dead_blocks in (True, False):
        flows = Workflows(timed=False)                              # (calls microseconds apart: no gaps to time)
        flows.dead_blocks = dead_blocks
        pol = WorkflowPolicy(flows)
        for i in range(20):
            _map_reduce(flows, pol, f"old{i}", 100 * (i + 1))
            flows.end(f"old{i}")
        for i in range(20):
            for j in range(4):
                pol.removed(k(100 * (i + 1) + j))
        _map_reduce(flows, pol, "x", 0, reduce=False)
        assert [flows.block_worth("x", k(j)) < 1.0 for j in range(4)] == [False, False, dead_blocks, dead_blocks]
        assert drain(pol) == ([2, 3, 0, 1] if dead_blocks else [0, 1, 2, 3])
