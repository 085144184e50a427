"""Math prompts: templated word problems with random numbers, one generator per problem family.

A family is the unit the held-out split works on (`math/family:NAME`): a drafter evaluated on a
held-out family meets a kind of problem it never trained on, not the same problem with new numbers.
Numbers are kept small and answers whole or to the cent, so a small target can solve them.
"""

from __future__ import annotations

import random
from collections.abc import Callable

NAMES = (
    "Tom", "Ana", "Priya", "Kenji", "Lucia", "Omar", "Mia", "Jonas", "Aisha", "Leo", "Sofia", "Ravi",
    "Emma", "Diego", "Hana", "Noah", "Zara", "Ivan", "Chloe", "Mateo", "Yuki", "Sam", "Nadia", "Felix",
)  # fmt: skip
GOODS = (
    ("pens", 1, 4), ("notebooks", 2, 6), ("apples", 1, 2), ("books", 8, 20), ("T-shirts", 9, 25),
    ("mugs", 4, 12), ("tickets", 6, 30), ("candles", 3, 9), ("plants", 5, 18), ("batteries", 1, 5),
)  # fmt: skip
CLOSERS = (
    "Explain step by step.",
    "Show your working.",
    "Solve it step by step and give the final answer.",
    "Explain your reasoning, then state the answer.",
)

Family = Callable[[random.Random], str]


def _shopping(rng: random.Random) -> str:
    goods, low, high = rng.choice(GOODS)
    price, quantity = rng.randint(low, high), rng.randint(2, 12)
    note = next(note for note in (10, 20, 50, 100, 200, 500) if note > price * quantity)
    return (
        f"A shop sells {goods} at ${price} each. {rng.choice(NAMES)} buys {quantity} {goods} and pays "
        f"with a ${note} note. How much change does {rng.choice(('he', 'she', 'they'))} get?"
    )


def _unit_price(rng: random.Random) -> str:
    goods, low, high = rng.choice(GOODS)
    small, large = rng.randint(2, 6), rng.randint(8, 24)
    small_price = rng.randint(low, high) * small
    large_price = round(small_price / small * large * rng.uniform(0.7, 1.1))
    return (
        f"A pack of {small} {goods} costs ${small_price}, and a pack of {large} {goods} costs "
        f"${large_price}. Which pack is the better deal per item, and by how much?"
    )


def _speed(rng: random.Random) -> str:
    speed, hours = rng.randint(30, 110), rng.randint(2, 9)
    vehicle = rng.choice(("car", "bus", "train", "truck"))
    return (
        f"A {vehicle} travels at {speed} km per hour for {hours} hours, then stops for lunch and drives "
        f"{rng.randint(20, 90)} km more. How far did it travel in total?"
    )


def _travel_time(rng: random.Random) -> str:
    speed = rng.choice((4, 5, 12, 15, 20, 40, 60, 80))
    distance = speed * rng.randint(2, 7) + rng.choice((0, speed // 2))
    how = {4: "walks", 5: "walks", 12: "cycles", 15: "cycles", 20: "rides a scooter"}.get(speed, "drives")
    return (
        f"{rng.choice(NAMES)} {how} {distance} km at a steady {speed} km per hour, leaving at "
        f"{rng.randint(6, 11)}:00 in the morning. At what time does the trip end?"
    )


def _ages(rng: random.Random) -> str:
    child, gap, years = rng.randint(3, 15), rng.randint(20, 40), rng.randint(2, 12)
    first, second = rng.sample(NAMES, 2)
    return (
        f"{first} is {gap} years older than {second}. In {years} years {first} will be "
        f"{child + gap + years} years old. How old is {second} now?"
    )


def _areas(rng: random.Random) -> str:
    length, width, tile = rng.randint(3, 12), rng.randint(2, 9), rng.choice((0.25, 0.5, 1))
    room = rng.choice(("kitchen", "bedroom", "hall", "classroom", "patio"))
    return (
        f"A {room} floor is {length} m long and {width} m wide. Each tile covers {tile} square metres "
        f"and costs ${rng.randint(3, 15)}. How many tiles are needed, and what do they cost in total?"
    )


def _fences(rng: random.Random) -> str:
    length, width = rng.randint(5, 40), rng.randint(4, 30)
    return (
        f"A rectangular garden is {length} m by {width} m. Fencing costs ${rng.randint(6, 25)} per metre "
        f"and the gate, {rng.choice((1, 2, 3))} m wide, needs no fencing. How much does the fence cost?"
    )


def _discounts(rng: random.Random) -> str:
    price, percent = rng.randint(12, 400), rng.choice((5, 10, 15, 20, 25, 30, 40, 50))
    item = rng.choice(("jacket", "bicycle", "lamp", "backpack", "pair of shoes", "printer"))
    return (
        f"A {item} costs ${price}. It is on sale at {percent}% off, and then a {rng.choice((5, 8, 10))}% "
        "sales tax is added to the sale price. What is the final price?"
    )


def _growth(rng: random.Random) -> str:
    start, percent, years = rng.randint(10, 90) * 100, rng.choice((2, 3, 4, 5, 8, 10)), rng.randint(2, 4)
    what = rng.choice(("a town's population", "a savings account", "a club's membership", "a salary"))
    return (
        f"{what.capitalize()} starts at {start} and grows by {percent}% each year. What is it after "
        f"{years} years? Round to the nearest whole number."
    )


def _recipes(rng: random.Random) -> str:
    flour, sugar, serves = rng.randint(2, 6) * 50, rng.randint(1, 4) * 25, rng.choice((4, 6, 8))
    wanted = rng.choice([count for count in (2, 3, 10, 12, 16, 20) if count != serves])
    dish = rng.choice(("pancakes", "a cake", "cookies", "muffins", "bread rolls"))
    return (
        f"A recipe for {dish} uses {flour} g of flour and {sugar} g of sugar and serves {serves}. "
        f"How much flour and sugar are needed to serve {wanted}?"
    )


def _work_rates(rng: random.Random) -> str:
    first, second = rng.choice(((2, 3), (3, 6), (4, 12), (5, 20), (6, 3), (10, 15), (8, 24)))
    job = rng.choice(("paint a fence", "fill a pool", "sort the letters", "mow a field"))
    people = rng.sample(NAMES, 2)
    return (
        f"{people[0]} can {job} alone in {first} hours; {people[1]} can do it alone in {second} hours. "
        "How long does it take if they work together?"
    )


def _interest(rng: random.Random) -> str:
    principal, rate, years = rng.randint(5, 80) * 100, rng.choice((2, 3, 4, 5, 6)), rng.randint(2, 6)
    return (
        f"{rng.choice(NAMES)} puts ${principal} in a bank account that pays {rate}% simple interest per "
        f"year. How much interest is earned after {years} years, and what is the balance then?"
    )


def _averages(rng: random.Random) -> str:
    scores = [rng.randint(50, 100) for _ in range(rng.randint(3, 6))]
    target = min(100, sum(scores) // len(scores) + rng.randint(1, 8))
    return (
        f"{rng.choice(NAMES)} scored {', '.join(map(str, scores))} on the first {len(scores)} tests. What "
        f"score is needed on the next test to bring the average to {target}?"
    )


def _fractions(rng: random.Random) -> str:
    slices = rng.choice((6, 8, 10, 12))
    eaten = rng.sample(range(1, slices // 2), 2)
    people = rng.sample(NAMES, 2)
    return (
        f"A pizza is cut into {slices} equal slices. {people[0]} eats {eaten[0]} slices and {people[1]} "
        f"eats {eaten[1]}. What fraction of the pizza is left? Give it in lowest terms."
    )


def _savings(rng: random.Random) -> str:
    goal, have, weekly = rng.randint(10, 60) * 10, rng.randint(0, 9) * 5, rng.choice((5, 8, 10, 12, 15, 20))
    item = rng.choice(("a bike", "a guitar", "a tablet", "a school trip", "a video game console"))
    return (
        f"{rng.choice(NAMES)} wants to buy {item} that costs ${goal}, already has ${have}, and saves "
        f"${weekly} every week. How many weeks until there is enough money?"
    )


def _probability(rng: random.Random) -> str:
    red, blue, green = rng.randint(1, 9), rng.randint(1, 9), rng.randint(0, 6)
    return (
        f"A bag holds {red} red, {blue} blue and {green} green marbles. Two marbles are drawn without "
        "putting the first back. What is the probability that both are red?"
    )


def _durations(rng: random.Random) -> str:
    start_hour, start_minute = rng.randint(7, 18), rng.choice((0, 10, 15, 20, 30, 45, 50))
    lengths = [rng.choice((25, 40, 45, 50, 55, 70, 90)) for _ in range(rng.randint(2, 4))]
    return (
        f"A meeting day starts at {start_hour}:{start_minute:02d}. There are {len(lengths)} sessions of "
        f"{', '.join(map(str, lengths))} minutes with a {rng.choice((5, 10, 15))}-minute break between "
        "each. When does the last session end?"
    )


FAMILIES: dict[str, Family] = {
    "shopping": _shopping,
    "unit-prices": _unit_price,
    "speed": _speed,
    "travel-time": _travel_time,
    "ages": _ages,
    "areas": _areas,
    "fences": _fences,
    "discounts": _discounts,
    "growth": _growth,
    "recipes": _recipes,
    "work-rates": _work_rates,
    "interest": _interest,
    "averages": _averages,
    "fractions": _fractions,
    "savings": _savings,
    "probability": _probability,
    "durations": _durations,
}
"""Problem family name -> a generator of one problem; the names are the held-out split's units."""


def math_problem(family: str, rng: random.Random) -> str:
    """One problem of `family` with fresh numbers, ending with a request to show the steps."""
    return f"{FAMILIES[family](rng)} {rng.choice(CLOSERS)}"
