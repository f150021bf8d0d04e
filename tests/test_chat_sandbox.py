"""The sandbox chat templates run in (ninfer_rt.sandbox, through ChatTemplate): escapes refused, errors in one line,
huge results and runaway loops refused quickly, ordinary templates rendered as plain Jinja renders them (the oracle).
"""

from __future__ import annotations

import time

import jinja2
import pytest

from ninfer_rt.chat import ChatTemplate
from ninfer_rt.errors import NinferError


MALICIOUS = [
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{% for c in [].__class__.__base__.__subclasses__() %}{{ c }}{% endfor %}",
    "{{ messages.__class__ }}",
    "{{ ''['__class__'] }}",
    "{{ '{0.__class__.__mro__}'.format(1) }}",
    "{{ (messages | attr('__class__')) }}",
    "{{ raise_exception.__globals__ }}",
    "{{ cycler.__init__.__globals__.os.system('touch {marker}') }}",
    "{{ namespace.__init__.__globals__ }}",
    "{% set ns = namespace(__dict__=1) %}",
    "{{ messages.append(1) }}",
]


@pytest.mark.parametrize("source", MALICIOUS)
def test_sandbox_escape_raises(source, tmp_path):
    marker = tmp_path / "pwned"
    with pytest.raises(NinferError) as e:
        ChatTemplate(source.replace("{marker}", str(marker))).render([{"role": "user", "content": "x"}])
    assert "\n" not in str(e.value)
    assert not marker.exists()


@pytest.mark.parametrize("source, message", [
    ("{{ raise_exception('only user and assistant roles') }}", "only user and assistant roles"),
    ("{% if %}", "syntax error"),
    ("{{ messages[0].content + 1 }}", "TypeError"),
])
def test_template_errors_are_one_line(source, message):
    with pytest.raises(NinferError, match=message) as e:
        ChatTemplate(source, origin="chat_template.jinja").render([{"role": "user", "content": "x"}])
    assert "\n" not in str(e.value) and str(e.value).startswith("chat_template.jinja:")


# Each would take seconds to minutes, or gigabytes, if run. Jinja's `**` is left-associative: `10**10**8` is
# (10**10)**8 = 10**80, harmless; `10**(10**8)` is the one that computes for minutes.
HUGE = [
    "{{ ('a'*1000000000)|length }}",
    "{{ 10**(10**8) }}",
    "{% set ns = namespace(x=3) %}{% for i in range(40) %}{% set ns.x = ns.x * ns.x %}{% endfor %}{{ ns.x > 0 }}",
    "{{ ('%1000000000s' % '')|length }}",
    "{{ ('%*d' % (1000000000, 1))|length }}",
    "{{ ('%1000000000s'|format(''))|length }}",
    "{{ '{:>1000000000}'.format('')|length }}",
    "{{ '{:>{w}}'.format('', w=1000000000)|length }}",
    "{{ ''.ljust(1000000000)|length }}",
    "{{ ('\t' * 1000).expandtabs(tabsize=1000000)|length }}",
    "{{ ''|center(1000000000)|length }}",
    "{{ ('a\n' * 100000)|indent(100000)|length }}",
    "{{ [1]|batch(1000000000, 0)|list|length }}",
    "{{ [1]|slice(slices=1000000000)|list|length }}",
    # a container holding one long string 10,000 times (10 GB as text), turned into text each way a template has
    "{% set s = 'x' * 1000000 %}{{ [s] * 10000 }}",
    "{% set s = 'x' * 1000000 %}{{ ([s] * 10000)|string|length }}",
    "{% set s = 'x' * 1000000 %}{{ ([s] * 10000)|tojson|length }}",
    "{% set s = 'x' * 1000000 %}{{ ([s] * 10000)|upper|length }}",
    "{% set s = 'x' * 1000000 %}{{ ('%s' % ([s] * 10000,))|length }}",
    "{% set s = 'x' * 1000000 %}{{ ('%s'|format([s] * 10000))|length }}",
    "{% set s = 'x' * 1000000 %}{{ '{}'.format([s] * 10000)|length }}",
    "{% set s = 'x' * 1000000 %}{{ (([s] * 10000) ~ '')|length }}",
    "{% set s = 'x' * 1000000 %}{{ ([[s] * 100] * 100)|join|length }}",
    "{% set ns = namespace(a='x' * 1000000) %}{{ [ns] * 10000 }}",
]

# The render's budget: loop iterations and calls, values built by ~, + and join, everything built, the output and
# what is written into blocks. These stop after bounded work (at most ~1,000,000 steps), not before any.
BUDGET = [
    "{% for i in range(100000) %}{% for j in range(100000) %}{% for k in range(100000) %}{% endfor %}{% endfor %}"
    "{% endfor %}x",
    "{% set ns = namespace(s='a') %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s|length }}",
    "{% set ns = namespace(s='a') %}{% for i in range(40) %}{% set ns.s = ns.s + ns.s %}{% endfor %}{{ ns.s|length }}",
    "{% set ns = namespace(l=[0]) %}{% for i in range(40) %}{% set ns.l = ns.l + ns.l %}{% endfor %}{{ ns.l|length }}",
    "{% set s = 'x' * 1000000 %}{{ ([s] * 1000)|join|length }}",
    # the second review's: a large int or a dict view printed, str methods that grow, sum over lists, tojson's indent
    "{{ [10 ** 4000] * 600000 }}",
    "{{ dict.fromkeys(range(2500), 'a' * 1000000).values() }}",
    "{{ ('a' * 2500).replace('a', 'a' * 1000000)|length }}",
    "{{ ('a' * 2500)|replace('a', 'a' * 1000000)|length }}",
    "{{ ('a' * 1000000).join('b' * 2500)|length }}",
    "{{ ('{0}' * 300000).format('a' * 10000)|length }}",
    "{{ ('{0:1000000}' * 2500).format('')|length }}",
    "{{ (('%(a)s' * 200000) % {'a': 'a' * 12500})|length }}",
    "{{ ('a' * 2500).translate(''.maketrans({'a': 'a' * 1000000}))|length }}",
    "{{ ([[0] * 1000000] * 130)|sum(start=[])|length }}",
    "{{ ([[0] * 1000000] * 130)|sum(none, [])|length }}",
    "{{ ([0] * 2500)|tojson(indent=1000000)|length }}",
    "{% set s = 'x' * 1000000 %}{% for i in range(100) %}{{ s }}{% endfor %}",
    # ... a recursive loop's own calls, text written into a block, join over a generator, one long ~ chain, recursion
    "{% for n in [[0] * 10000] * 1000 recursive %}{% if n is iterable %}{{ loop(n) }}{% endif %}{% endfor %}",
    "{% set s = 'x' * 1000000 %}{% set big %}{% for i in range(300) %}{{ s }}{% endfor %}{% endset %}{{ big|length }}",
    "{% set s = 'x' * 1000000 %}{{ ([s] * 200)|map('string')|join|length }}",
    "{% set s = 'x' * 1000000 %}{% set t = s * 1 %}{{ (s ~ s ~ s ~ s ~ s ~ s ~ s ~ s ~ s ~ s ~ s ~ s ~ s ~ s ~ s ~ s ~ "
    "s ~ s ~ s ~ s ~ s ~ s ~ s ~ s ~ s ~ s ~ s ~ s ~ s ~ s ~ s ~ s ~ s ~ s ~ s ~ s ~ s ~ s ~ s ~ s ~ s ~ s ~ s ~ s ~ s ~ "
    "s ~ s ~ s ~ s ~ s ~ s ~ s ~ s ~ s ~ s ~ s ~ s ~ s ~ s ~ s ~ s ~ s ~ s ~ s ~ s ~ s ~ s ~ s ~ s ~ s ~ s ~ s ~ s ~ s)|length }}",
    "{% macro f(n) %}{% if n %}{{ f(n - 1) }}{{ f(n - 1) }}{% endif %}{% endmacro %}{{ f(28) }}",
]


@pytest.mark.parametrize("source, seconds", [(h, 2.0) for h in HUGE] + [(b, 10.0) for b in BUDGET])
def test_sandbox_refuses_huge_results_quickly(source, seconds):
    t0 = time.perf_counter()
    with pytest.raises(NinferError, match="blocked by the sandbox") as e:
        ChatTemplate(source).render([{"role": "user", "content": "x"}])
    # HUGE: refused before any work; BUDGET: after a bounded amount (a million steps take ~3 s at worst, macro
    # calls); the payloads themselves take hours or all the memory
    assert time.perf_counter() - t0 < seconds
    assert "\n" not in str(e.value)


# The same operators, methods and filters at ordinary sizes, up to the limits themselves (1,000,000 items,
# 65,536-bit integers).
WITHIN_LIMITS = (
    "{{ '-' * 3 }}|{{ 3 * [1, 2] }}|{{ 2 ** 100 }}|{{ 2 ** -2 }}|{{ 2.5 ** 3 }}|{{ 7 % 3 }}|{{ 1.5 * 2 }}|"
    "{{ '%5s|%-3d|%.2f|%%' % ('ab', 7, 3.14159) }}|{{ '%*d' % (4, 2) }}|{{ '%(k)s' % {'k': 'v'} }}|"
    "{{ '{:>6}|{!r}'.format('x', 'y') }}|{{ '{0}{1}{0}'.format('a', 'b') }}|{{ 'x'.ljust(4) }}|"
    "{{ 'x'.center(5, '*') }}|{{ '7'.zfill(3) }}|"
    "{{ 'a\tb'.expandtabs(4) }}|{{ 'a'|center(5) }}|{{ 'a\nb'|indent(2, true) }}|{{ 'a\nb'|indent('> ') }}|"
    "{{ [1, 2, 3]|batch(2, 0)|list }}|{{ [1, 2, 3]|slice(2)|list }}|{{ '%s!'|format('q') }}|"
    "{{ [{'a': 1}, {'a': 2}]|sum('a') }}|{{ [1, 2]|sum(start=10) }}|{{ [{'a': 1}]|sum('a', 5) }}|"
    "{{ ('a' * 1000000)|length }}|{{ ('%1000000s' % '')|length }}|{{ (2 ** 65535) > 0 }}"
)


LOOPS = (
    "{% for k, v in {'a': 1, 'b': 2}|dictsort %}{{ loop.index }}/{{ loop.length }}/{{ loop.revindex0 }}:{{ k ~ v }}"
    "{{ loop.cycle('x', 'y') }}{% if loop.last %}.{% endif %}{% endfor %}"
    "{% for i in [] %}never{% else %}empty{% endfor %}"
    "{% for n in [[1, [2]], [3]] recursive %}[{% if n is iterable %}{{ loop(n) }}{% else %}{{ n }}{% endif %}]{% endfor %}"
    "{% for c in 'abc' if c != 'b' %}{{ c + '!' }}{{ ['p', 'q']|join('-') ~ loop.index }}{% endfor %}"
)


def test_sandbox_budget_keeps_jinja_loop_semantics():
    # oracle: jinja without any sandbox; loops see the budget's generator, so loop.length, else, recursion and
    # filtered loops must come out the same
    assert ChatTemplate(LOOPS).render([]) == jinja2.Environment().from_string(LOOPS).render()


def test_sandbox_loop_budget_is_exact():
    # 1,000,000 loop iterations and calls together a render: a list of exactly that many runs, one more is refused
    loop = "{% for i in items %}{% endfor %}ok"
    t = ChatTemplate(loop)
    assert t.render([], items=[0] * 1_000_000) == "ok"
    with pytest.raises(NinferError, match="more than 1,000,000 loop iterations and calls"):
        t.render([], items=[0] * 1_000_001)
    # each render starts with the whole budget
    assert [t.render([], items=[0] * 1_000_000) for _ in range(2)] == ["ok"] * 2
    # calls count as well: 1,000 range() calls and 999,000 iterations are 1,000 over
    with pytest.raises(NinferError, match="loop iterations and calls"):
        ChatTemplate("{% for i in range(1000) %}{% for j in range(999) %}{% endfor %}{% endfor %}").render([])


def test_sandbox_deadline_and_memory_backstops(monkeypatch):
    # a render that stays inside every count still stops at the wall-time and resident-memory limits
    import ninfer_rt.sandbox as sandbox

    slow = "{% for i in range(100000) %}{% set x = ('a' * 100000).split('a') %}{% endfor %}"
    monkeypatch.setattr(sandbox, "_MAX_SECONDS", 0.3)
    t0 = time.perf_counter()
    with pytest.raises(NinferError, match="the render ran longer than 0 s"):
        ChatTemplate(slow).render([])
    assert time.perf_counter() - t0 < 3
    monkeypatch.setattr(sandbox, "_MAX_SECONDS", 60.0)
    # resident memory as the guard reads it: 1 GiB at the render's start, then 1 GiB more at each reading (the
    # process's real RSS depends on what the allocator kept from earlier tests, so it is not the oracle here)
    readings = iter(range(1, 100))
    monkeypatch.setattr(sandbox, "_rss", lambda: next(readings) << 30)
    grow = "{% set ns = namespace(l=[]) %}{% for i in range(100) %}{% set ns.l = ns.l + [('a' * 1000000) ~ i] %}" \
           "{% endfor %}{{ ns.l|length }}"
    with pytest.raises(NinferError, match="grew the process by more than 2 GiB"):
        ChatTemplate(grow).render([])
    assert next(readings) <= 5  # refused at the second large value after the start: 2 GiB is not yet refused


ACCUMULATE = (
    "{% set ns = namespace(out='', roles=[]) %}{% for m in messages %}"
    "{% set ns.out = ns.out + '<|im_start|>' + m.role + '\n' + m.content + '<|im_end|>\n' %}"
    "{% set ns.roles = ns.roles + [m.role] %}{% endfor %}{{ ns.out }}{{ ns.roles|length }}"
    "{% set ns2 = namespace(s='') %}{% for m in messages %}{% set ns2.s = ns2.s ~ m.content ~ '\n' %}{% endfor %}"
    "{{ ns2.s|length }}{{ template }}"
)


def test_sandbox_leaves_accumulating_templates_alone():
    # oracle: jinja without any sandbox. Templates that build the prompt piece by piece copy O(n^2) characters:
    # 5,000 messages must still render, as they do in transformers
    msgs = [{"role": "user" if i % 2 == 0 else "assistant", "content": f"message {i} " * 8} for i in range(5_000)]
    want = jinja2.Environment(trim_blocks=True, lstrip_blocks=True).from_string(ACCUMULATE).render(
        messages=msgs, template="T")
    assert ChatTemplate(ACCUMULATE).render(msgs, template="T") == want


def test_sandbox_size_checks_leave_ordinary_sizes_alone():
    # oracle: jinja without any sandbox
    assert ChatTemplate(WITHIN_LIMITS).render([]) == jinja2.Environment().from_string(WITHIN_LIMITS).render()
    for just_over in ("{{ 'a' * 1000001 }}", "{{ [0] * 1000 * 1001 }}", "{{ 2 ** 65536 }}", "{{ 'x'.ljust(1000001) }}"):
        with pytest.raises(NinferError, match="blocked by the sandbox"):
            ChatTemplate(just_over).render([])


def test_nesting_too_deep_is_one_line():
    looped = {"role": "user", "content": "x"}
    looped["self"] = looped
    deep: list = []
    cur = deep
    for _ in range(5000):
        cur.append([])
        cur = cur[0]
    for messages in ([looped], [{"role": "user", "content": "x", "extra": deep}]):
        with pytest.raises(NinferError, match="nest too deeply"):
            ChatTemplate("{{ messages|length }}").render(messages)
    with pytest.raises(NinferError, match="nests too deeply to compile"):
        ChatTemplate("{{ " + "(" * 300 + "1" + ")" * 300 + " }}")
