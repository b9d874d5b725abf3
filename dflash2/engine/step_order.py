"""Priorities across steps: which model steps next, and whether a step's first token is committed at once.

Several models (EngineConfig.models) share one page pool and a step runs one model's batch. The model that steps
next is the one with the most urgent work (effective priority of its waiting or running requests), ties going to
the one that stepped least recently; a model with work that other models' steps passed over
`max_model_skip_steps` times goes first (no model starves).

A step that samples the first token of a request that outranks a running request, and that no request in the step
outranks, is committed right after its launch (Engine.step()).
"""
from __future__ import annotations

import time
from collections.abc import Iterable, Mapping

from dflash2.engine.plan import StepPlan
from dflash2.engine.served_model import ServedModel
from dflash2.request import Request


def plan_next(models: Mapping[str, ServedModel], step_number: int,
              max_skip_steps: int) -> tuple[ServedModel | None, StepPlan]:
    """The plan of the model that steps next (an empty plan if no model has anything to run now); records which
    model stepped (`step_number`) and how long the others with work have waited."""
    if len(models) == 1:
        served = next(iter(models.values()))
        return served, served.scheduler.plan()
    order = step_order(models.values(), max_skip_steps)
    chosen, plan = None, StepPlan()
    for served in order:
        plan = served.scheduler.plan()
        if plan:
            chosen = served
            break
    for served in order:  # the models with work that did not step wait one step longer
        served.skipped_steps = 0 if served is chosen else served.skipped_steps + 1
    if chosen is not None:
        chosen.last_step = step_number
    return chosen, plan


def step_order(models: Iterable[ServedModel], max_skip_steps: int) -> list[ServedModel]:
    """The models with work, in the order they get to plan this step: one skipped for max_skip_steps steps while
    it had work first (the longest skipped first), then by their most urgent request's effective priority, then
    the one that stepped least recently (equal priorities take turns)."""
    now = time.monotonic()
    keyed = []
    for served in models:
        top = served.scheduler.top_priority(now)
        if top is None:
            served.skipped_steps = 0  # no work: nothing to starve
            continue
        starving = served.skipped_steps >= max_skip_steps
        keyed.append(((not starving, -served.skipped_steps if starving else 0, -top, served.last_step), served))
    keyed.sort(key=lambda item: item[0])
    return [served for _, served in keyed]


def step_priorities(plan: StepPlan, requests: Mapping[str, Request]) -> tuple[int | None, int | None, int | None]:
    """The lowest and highest priority among the step's requests, and the highest among those whose first
    token it samples (None: no such request). One pass over the chunks, on every step: a step whose first
    token outranks another request in it is committed at once (Engine.step())."""
    lowest = top = first_token_top = None
    for chunk in plan.chunks:
        request = requests.get(chunk.request_id)
        if request is None:
            continue
        priority = request.priority
        if lowest is None or priority < lowest:
            lowest = priority
        if top is None or priority > top:
            top = priority
        if chunk.sample and request.num_output_tokens == 0 \
                and (first_token_top is None or priority > first_token_top):
            first_token_top = priority
    return lowest, top, first_token_top


def first_token_is_urgent(priorities: tuple[int | None, int | None, int | None],
                       models: Iterable[ServedModel]) -> bool:
    """Whether the step (its step_priorities()) samples the first token of a request that no request in it
    outranks and that outranks some running request (in the step or waiting out of it): that step is committed
    at once."""
    lowest, top, first_token_top = priorities
    if first_token_top is None or first_token_top < top:
        return False
    if first_token_top > lowest:
        return True
    return any(r.priority < first_token_top for served in models for r in served.scheduler.running.values())
