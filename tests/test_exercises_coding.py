"""Coding exercises (helpers.exercises): every course solution is right over its whole sweep of
cases on live ranks, and every named wrong answer is called wrong with its cause, on one case."""
from __future__ import annotations

import pytest

from helpers.exercises import EXERCISES, check, reveal
from helpers.exercises.coding import MISTAKES, Case, is_empty

NOTEBOOKS_WITH_CODING = {"01", "03", "04", "05", "07", "08", "09"}


def test_every_notebook_that_teaches_a_block_has_a_coding_exercise():
    assert NOTEBOOKS_WITH_CODING <= {ex.notebook for ex in EXERCISES.values()}


def test_every_exercise_has_two_named_mistakes_and_a_sweep():
    for ex in EXERCISES.values():
        assert len(ex.mistakes) >= 2, ex.id
        assert all(m.name in MISTAKES for m in ex.mistakes), ex.id
        assert len(ex.cases) >= 2, ex.id
        assert len({c.world for c in ex.cases}) >= 2 or len({c.seed for c in ex.cases}) >= 2, ex.id


@pytest.mark.parametrize("name", sorted(EXERCISES))
def test_the_course_solution_is_right(name):
    verdict = check(EXERCISES[name].solution, name)
    assert verdict.right, verdict.why


@pytest.mark.parametrize("name,index", [(n, i) for n in sorted(EXERCISES)
                                        for i in range(len(EXERCISES[n].mistakes))])
def test_each_wrong_answer_is_wrong_for_its_named_cause(name, index):
    mistake = EXERCISES[name].mistakes[index]
    verdict = check(mistake.fn, name, first_case_only=True)
    assert not verdict.right, f"{mistake.name}: called right"
    assert mistake.says in verdict.why, f"{mistake.name}: {verdict.why}"


def skeleton(x):
    """A docstring only, then the placeholder."""
    ...


def not_implemented(x):
    raise NotImplementedError("your code here")


def written(x):
    """Has a body."""
    return x


def test_an_empty_body_answers_at_once_without_ranks(monkeypatch):
    import helpers.exercises.coding as coding
    monkeypatch.setattr(coding, "_ranks", lambda world: pytest.fail("started ranks"))
    for fn in (skeleton, not_implemented):
        assert is_empty(fn)
        verdict = check(fn, "ring_all_reduce")
        assert not verdict.right and "the body is empty" in verdict.why
    assert not is_empty(written)


def test_an_unknown_exercise_is_one_clear_error():
    with pytest.raises(ValueError, match="exercise must be one of"):
        check(written)


def test_the_solution_is_folded_html_from_the_module_itself():
    shown = reveal("ring_all_reduce")
    assert shown._repr_html_().startswith("<details>")
    assert "def ring_all_reduce" in repr(shown)


def test_a_case_names_its_group():
    assert str(Case(world=4, seed=0, size=6, group=(1, 3))) == "4 ranks, group [1, 3], size 6, seed 0"


def _skips_the_collective_on_rank_1(x):
    import torch.distributed as dist
    if dist.get_rank() != 1:
        dist.all_reduce(x)
    return x


def _mismatched_dtypes(x):
    import torch.distributed as dist
    if dist.get_rank() == 0:
        x = x.double()
    dist.all_reduce(x)
    return x.float()


def test_a_reader_deadlock_names_the_waiting_rank_and_the_next_check_works():
    verdict = check(_skips_the_collective_on_rank_1, "ring_all_reduce", first_case_only=True)
    assert not verdict.right and verdict.why.startswith("deadlock")
    assert "in all_reduce" in verdict.why and "same collectives in the same order" in verdict.why
    assert check(EXERCISES["ring_all_reduce"].solution, "ring_all_reduce",
                 first_case_only=True).right  # the ranks were restarted


def test_collectives_that_differ_across_ranks_are_named():
    verdict = check(_mismatched_dtypes, "ring_all_reduce", first_case_only=True)
    assert not verdict.right and "CollectiveMismatchError" in verdict.why
    assert "dtype: torch.float64 on rank(s) [0]" in verdict.why


def _notebook_cells(number: str) -> list[dict]:
    import json
    from pathlib import Path
    (path,) = Path(__file__).resolve().parent.parent.glob(f"notebooks/{number}_*.ipynb")
    return json.loads(path.read_text())["cells"]


@pytest.mark.parametrize("name", sorted(EXERCISES))
def test_the_notebook_asks_before_it_answers(name):
    """Each coding exercise is in its notebook as an empty skeleton whose committed check says
    so, and nothing above it names the function (so no answer is printed above the question);
    the course's version is folded in a cell after it."""
    import ast
    ex = EXERCISES[name]
    cells = _notebook_cells(ex.notebook)
    sources = ["".join(c["source"]) for c in cells]
    asked = [i for i, s in enumerate(sources) if f"def {name}(" in s]
    assert len(asked) == 1, f"notebook {ex.notebook} should define {name} once"
    i = asked[0]
    assert sources[i].rstrip().endswith(f"check({name})"), "the skeleton's cell ends with check()"
    skeleton = next(n for n in ast.parse(sources[i]).body
                    if isinstance(n, ast.FunctionDef) and n.name == name)
    assert all(isinstance(s, (ast.Pass, ast.Expr)) for s in skeleton.body), "the body is empty"
    shown = "".join("".join(o.get("text", "")) + "".join(o.get("data", {}).get("text/plain", ""))
                    for o in cells[i].get("outputs", []))
    assert "the body is empty" in shown
    assert not any(name in s for s in sources[:i]), f"{name} appears above its exercise"
    assert any(f'reveal("{name}")' in s for s in sources[i + 1:]), "no folded solution after it"


def test_checks_from_two_threads_each_run_on_their_own_world_sizes():
    """Two checks at once share one set of ranks, resized per case: each still gets every case
    on the world size it names (a case run on the other thread's size would be a wrong verdict)."""
    import threading
    solution = EXERCISES["ring_all_reduce"].solution
    verdicts = []
    threads = [threading.Thread(target=lambda: verdicts.append(check(solution, "ring_all_reduce")))
               for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert len(verdicts) == 2 and all(v.right for v in verdicts), verdicts


def _batched_ring(x):
    """The ring with batch_isend_irecv and P2POp: torch's own calls, logged one by one."""
    import torch
    import torch.distributed as dist
    rank, n = dist.get_rank(), dist.get_world_size()
    chunks = list(x.clone().tensor_split(n))

    def hop(out, into):
        ops = [dist.P2POp(dist.isend, chunks[out], (rank + 1) % n),
               dist.P2POp(dist.irecv, into, (rank - 1) % n)]
        for work in dist.batch_isend_irecv(ops):
            work.wait()
    for step in range(n - 1):
        into = torch.empty_like(chunks[(rank - step - 1) % n])
        hop((rank - step) % n, into)
        chunks[(rank - step - 1) % n] += into
    for step in range(n - 1):
        hop((rank + 1 - step) % n, chunks[(rank - step) % n])
    return torch.cat(chunks)


def _ring_by_group_ranks(x):
    """The course's ring, each peer given as group_dst=/group_src= and the calls' other
    arguments by position: read by their names all the same."""
    import torch
    import torch.distributed as dist
    rank, n = dist.get_rank(), dist.get_world_size()
    chunks = list(x.clone().tensor_split(n))
    for step in range(n - 1):
        out, into = (rank - step) % n, (rank - step - 1) % n
        incoming = torch.empty_like(chunks[into])
        sending = dist.isend(chunks[out], None, None, 0, group_dst=(rank + 1) % n)
        dist.recv(incoming, None, None, 0, group_src=(rank - 1) % n)
        sending.wait()
        chunks[into] += incoming
    for step in range(n - 1):
        out, into = (rank + 1 - step) % n, (rank - step) % n
        sending = dist.isend(chunks[out], group_dst=(rank + 1) % n)
        dist.recv(chunks[into], group_src=(rank - 1) % n)
        sending.wait()
    return torch.cat(chunks)


@pytest.mark.parametrize("fn", [_batched_ring, _ring_by_group_ranks])
def test_right_answers_written_another_way_are_right(fn):
    verdict = check(fn, "ring_all_reduce")
    assert verdict.right, verdict.why


def test_arguments_passed_by_position_are_read_by_their_names():
    from helpers.exercises.calls import _describe
    import inspect
    import torch
    import torch.distributed as dist
    signature = inspect.signature(dist.all_reduce)
    call = _describe("all_reduce", signature, (torch.ones(3), dist.ReduceOp.MAX), {})
    assert call.nbytes == 12 and call.reduce_op == "MAX" and call.total == 3.0
