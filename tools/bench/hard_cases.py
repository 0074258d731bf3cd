"""Hard cross-chunk cases: a chunk B that cannot be read without the chunk A before it.

Each case is [A, B] plus questions whose answers need both chunks. In every case B refers to
what A defines only by an indirect handle (a function or constant name, a role, a table row, a
step number), so B's KV computed after A differs from B encoded alone in exactly the way a
conditioning patch must restore:

- "code": A defines functions and constants, B calls them and prints the results;
- "roles": A introduces people with their roles, B tells a story naming only the roles;
- "table": A is a table of parts, B refers to rows by their number;
- "steps": A is a numbered procedure, B is a log that refers to steps by number.

Each question ends where its answer (or the answer's first token) should follow, so the
next-token distribution after it is what depends on reading B through A. The texts are written
for this module and fixed, so figures measured on them compare across runs (`agentwin diagnose
--case NAME`, `tools.bench.harness.measure_texts(..., *hard_case(name).texts())`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class HardCase:
    """One case: antecedent `a`, chunk `b` that reads it, questions read after [A, B]."""

    name: str
    a: str
    b: str
    questions: tuple[str, ...]
    answers: tuple[str, ...]  # the expected answer of each question (for reading results)

    def texts(self) -> tuple[str, str, tuple[str, ...]]:
        return self.a, self.b, self.questions


_CODE_A = '''# inventory.py: helpers shared by the warehouse scripts
SHELF_LIMIT = 12
DISCOUNT_PERCENT = 15
WAREHOUSE_CODE = "NX"

def crate_count(items):
    """Crates needed for `items` pieces, SHELF_LIMIT per crate."""
    return (items + SHELF_LIMIT - 1) // SHELF_LIMIT

def discounted(price):
    """Price after the standing discount, rounded down."""
    return price * (100 - DISCOUNT_PERCENT) // 100

def label(n):
    """A crate label such as NX-007."""
    return f"{WAREHOUSE_CODE}-{n:03d}"

def double_if_odd(x):
    return x * 2 if x % 2 else x
'''

_CODE_B = '''# report.py: runs after inventory.py in the same session
orders = [30, 7, 25]
total = 0
for amount in orders:
    total += crate_count(amount)
print("crates:", total)

price = discounted(200)
print("price:", price)

first = label(crate_count(50))
print("first label:", first)

value = double_if_odd(crate_count(13))
print("value:", value)

tags = [label(i) for i in range(1, 4)]
print("last tag:", tags[-1])
'''

_ROLES_A = (
    "The crew of the survey ship Merrow, as listed in the captain's notes. The navigator is Ilse "
    "Varga, a quiet woman from the northern islands who keeps the star charts in a tin box. The "
    "ship's cook is Tomas Brenner, who came aboard at the last minute and hates the cold. The "
    "engineer is Odile Mercer; she repaired the boiler twice during the first week. The youngest "
    "deckhand is Piet Laine, who writes letters to his sister every evening. The doctor is Hugo "
    "Sandoval, an old friend of the captain. The radio operator is Marta Keel, who can send forty "
    "words a minute."
)

_ROLES_B = (
    " On the ninth day the weather turned. The navigator climbed to the bridge at dawn and "
    "reported that the charts showed a reef eleven miles to the east. The engineer answered that "
    "the boiler could hold only half speed until noon. The cook refused to light the stove while "
    "the ship rolled, so breakfast was bread and cold tea. The radio operator sent three messages "
    "to the harbour at Sellin but received no reply. By afternoon the youngest deckhand had cut "
    "his hand on a frozen line, and the doctor stitched it with seven stitches. In the evening the "
    "navigator changed course to the south, and the engineer promised full speed by midnight. The "
    "cook finally served soup at nine, and the doctor declared it the best meal of the voyage. "
    "The radio operator stayed at her post until two in the morning."
)

_TABLE_A = (
    "Parts list for the pump assembly (row, part, material, quantity, supplier):\n"
    "Row 1 | impeller | bronze | 2 | Halden Works\n"
    "Row 2 | shaft seal | rubber | 6 | Corvo Supply\n"
    "Row 3 | bearing | steel | 4 | Ostrava Metal\n"
    "Row 4 | housing | cast iron | 1 | Halden Works\n"
    "Row 5 | gasket | cork | 9 | Pellam & Sons\n"
    "Row 6 | drive belt | nylon | 3 | Corvo Supply\n"
)

_TABLE_B = (
    "\nInspection notes, week 14. The part in row 3 showed wear on both faces and must be replaced "
    "before Friday; order the same quantity again from the same supplier. The part in row 5 was "
    "fine, but the supplier of row 5 raised its prices by a third. Row 1 passed the pressure test "
    "at 40 bar. Row 6 snapped during the load test, so the whole quantity listed in its row has to "
    "be reordered. The part in row 2 leaked slightly; the inspector suggests switching to the "
    "supplier of row 3 for it. Row 4 needs no action this quarter."
)

_STEPS_A = (
    "Procedure for restarting the cold store after a power cut:\n"
    "Step 1. Close the outer door and check that the seal is intact.\n"
    "Step 2. Switch on the main breaker marked C4.\n"
    "Step 3. Wait until the compressor light turns green, usually about four minutes.\n"
    "Step 4. Set the thermostat to minus eighteen degrees.\n"
    "Step 5. Open the vent valve by two full turns.\n"
    "Step 6. Record the time and the temperature in the blue logbook.\n"
    "Step 7. Call the site manager, Rosa Imbert, on extension 214.\n"
)

_STEPS_B = (
    "\nNight log, 14 March. Power came back at 02:10. I did step 1 and found the seal torn at the "
    "bottom corner, so I taped it. Step 2 tripped at the first attempt; it held on the second. "
    "Step 3 took eleven minutes instead of the usual time. For step 4 the dial would only go to "
    "minus fifteen, so I left it there. I skipped step 5 because the valve was already open. "
    "Step 6 was done at 02:41 with the reading at minus six. Step 7: no answer, left a message."
)

CASES: dict[str, HardCase] = {
    "code": HardCase(
        "code", _CODE_A, _CODE_B,
        (
            '\n# Question: what does print("price:", price) output?\n# Answer: it prints "price:',
            '\n# The program prints "first label: ',
            "\n# Output of the program:\n# crates:",
            "\n# In report.py, crate_count(13) returns",
        ),
        ("170", "NX-005", "7", "2"),
    ),
    "roles": HardCase(
        "roles", _ROLES_A, _ROLES_B,
        (
            "\nThe navigator who reported the reef is named",
            "\nThe deckhand whose hand was stitched is named",
            "\nThe crew member who refused to light the stove is named",
            "\nQuestion: Who stayed at her post until two in the morning?\nAnswer: Marta",
        ),
        ("Ilse Varga", "Piet Laine", "Tomas Brenner", "Keel"),
    ),
    "table": HardCase(
        "table", _TABLE_A, _TABLE_B,
        (
            "\nThe part that showed wear on both faces is the",
            "\nThe supplier whose prices rose by a third is",
            "\nThe number of drive belts to reorder is",
            "\nThe part that leaked slightly is the",
        ),
        ("bearing", "Pellam & Sons", "3", "shaft seal"),
    ),
    "steps": HardCase(
        "steps", _STEPS_A, _STEPS_B,
        (
            "\nThe breaker that tripped at the first attempt is marked",
            "\nThe night guard tried to call",
            "\nThe thermostat should have been set to minus",
        ),
        ("C4", "Rosa Imbert", "eighteen"),
    ),
}


def hard_case(name: str) -> HardCase:
    """The case `name` (one of `CASES`)."""
    if name not in CASES:
        raise ValueError(f"unknown hard case {name!r}; one of {sorted(CASES)}")
    return CASES[name]


def hard_case_names() -> list[str]:
    return list(CASES)


def parse_case_names(parser: Any, text: str) -> list[str]:
    """The comma-separated case names of a study's `--cases`; `parser.error` (argparse) names any
    that is not one of `CASES`."""
    names = text.split(",")
    unknown = [n for n in names if n not in CASES]
    if unknown:
        parser.error(f"unknown case(s) {', '.join(unknown)}: choose from {', '.join(CASES)}")
    return names
