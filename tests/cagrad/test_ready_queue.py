"""The ready queue replays libstdc++'s std::priority_queue exactly.

The oracle is a real std::priority_queue, compiled here with g++ when a
compiler is on the machine.
"""

from __future__ import annotations

import random
import shutil
import subprocess

import pytest

from cagrad.autograd.ready_queue import ReadyQueue

CPP = r"""
#include <cstdio>
#include <queue>
#include <vector>
struct E { unsigned long long p; int id; };
struct C { bool operator()(const E& a, const E& b) const { return a.p < b.p; } };
int main() {
  std::priority_queue<E, std::vector<E>, C> q; char op;
  while (std::scanf(" %c", &op) == 1) {
    if (op == '+') { E e; std::scanf("%llu %d", &e.p, &e.id); q.push(e); }
    else { std::printf("%d\n", q.top().id); q.pop(); }
  }
}
"""


@pytest.fixture(scope="module")
def std_priority_queue(tmp_path_factory):
    cxx = shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        pytest.skip("no C++ compiler to build the std::priority_queue oracle")
    d = tmp_path_factory.mktemp("pq")
    (d / "pq.cpp").write_text(CPP)
    subprocess.run([cxx, "-O1", "-o", str(d / "pq"), str(d / "pq.cpp")], check=True)
    return str(d / "pq")


def test_matches_std_priority_queue_with_ties(std_priority_queue):
    for trial in range(200):
        rng = random.Random(trial)
        ops, popped, size, q = [], [], 0, ReadyQueue()
        for i in range(rng.randint(1, 80)):
            if size and rng.random() < 0.4:
                ops.append("-")
                popped.append(q.pop())
                size -= 1
            else:
                # many ties: AccumulateGrad nodes all have UINT64_MAX
                p = rng.choice([1, 2, 3, 5, 2**64 - 1]) if rng.random() < 0.7 else rng.randint(0, 9)
                ops.append(f"+ {p} {i}")
                q.push(p, i)
                size += 1
        while size:
            ops.append("-")
            popped.append(q.pop())
            size -= 1
        out = subprocess.run(
            [std_priority_queue], input="\n".join(ops), capture_output=True, text=True, check=True
        ).stdout.split()
        assert [int(x) for x in out] == popped, f"trial {trial}"


def test_pop_empty_raises():
    with pytest.raises(IndexError):
        ReadyQueue().pop()
