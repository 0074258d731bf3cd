"""The material the benchmark's agents work on, generated here so that every run sees the same:
a PDF of fact pages, a small web site served on 127.0.0.1, and a video of coloured scenes, with
a text rendering of its frames for text-only models.

Everything is seeded and synthetic (a fictional island, Velmora): no download, no randomness
between runs.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import numpy as np

TOPICS = ["harbour", "lighthouse", "ferry", "market", "archive", "school", "mill", "bridge", "chapel", "orchard",
          "quarry", "well", "bakery", "forge", "observatory", "boatyard", "post office", "salt works", "infirmary",
          "library", "weir", "signal tower", "granary", "tannery", "customs house", "rope walk"]
NAMES = ["Anja Roth", "Tobias Mertens", "Lena Okafor", "Pavel Ilic", "Mira Santos", "Jonas Berg", "Ida Novak",
         "Emil Strand", "Sofia Lindqvist", "Karim Haddad", "Greta Vos", "Nils Aalto", "Rosa Ferreira", "Oskar Dahl"]
OBJECTS = ["tide log", "brass bell", "fog horn", "ledger", "weather chart", "key ring", "lantern", "map chest",
           "grain scale", "iron gate", "clock", "seal"]
VERBS = ["repairs", "keeps", "inspects", "paints", "records", "guards", "winds", "counts"]
ANSWER_FACT = "The lighthouse keeper of Velmora is Tobias Mertens, who lights the lamp at dusk."


def doc_pages(pages: int, sentences: int, seed: int = 0, answer_page: int = 14) -> list[str]:
    """`pages` page texts of `sentences` fact sentences each; page `answer_page` (1-based, clamped)
    also holds `ANSWER_FACT`."""
    rng = random.Random(seed)
    out = []
    for number in range(1, pages + 1):
        topic = TOPICS[(number - 1) % len(TOPICS)]
        lines = [f"Chapter {number}: the {topic} of Velmora."]
        for _ in range(sentences):
            name, obj, verb = rng.choice(NAMES), rng.choice(OBJECTS), rng.choice(VERBS)
            year, hour = rng.randint(1850, 1990), rng.randint(5, 21)
            lines.append(rng.choice([
                f"{name} {verb} the {obj} of the {topic} since {year}.",
                f"Every day at {hour}:00 {name} {verb} the {obj} near the {topic}.",
                f"The {obj} of the {topic} was made in {year} and is kept by {name}.",
                f"In {year} a storm damaged the {topic}; {name} rebuilt it by {year + rng.randint(1, 9)}.",
            ]))
        if number == min(answer_page, pages):
            lines.insert(2, ANSWER_FACT)
        out.append(" ".join(lines))
    return out


# ---- the web site ------------------------------------------------------------------------------

SITE_PAGES = ["index", "harbour", "lighthouse", "ferry", "market", "archive", "records-1890", "records-1920", "people"]


def site_html(paragraphs: int, seed: int = 1) -> dict[str, str]:
    """Path -> HTML of a small site about Velmora: an index linking every page, each page a few
    paragraphs of facts and links to its neighbours and back to the index; a search form."""
    rng = random.Random(seed)
    pages: dict[str, str] = {}
    for index, slug in enumerate(SITE_PAGES):
        title = "Velmora" if slug == "index" else slug.replace("-", " ").title()
        body = [f"<h1>{title}</h1>"]
        for _ in range(paragraphs):
            name, obj, verb = rng.choice(NAMES), rng.choice(OBJECTS), rng.choice(VERBS)
            body.append(f"<p>{name} {verb} the {obj} of the {slug.replace('-', ' ')}; it dates from "
                        f"{rng.randint(1850, 1990)} and is shown on Tuesdays at {rng.randint(8, 18)}:00.</p>")
        if slug == "lighthouse":
            body.append(f"<p>{ANSWER_FACT}</p>")
        links = SITE_PAGES[1:] if slug == "index" else \
            ["index"] + [SITE_PAGES[j] for j in (index - 1, index + 1) if 0 < j < len(SITE_PAGES)]
        names = {s: ("Home" if s == "index" else s.replace("-", " ").title()) for s in links}
        body.append("<nav>" + " ".join(f'<a href="/{s}.html">{names[s]}</a>' for s in links) + "</nav>")
        if slug == "index":
            body.append('<form action="/search" method="get"><input name="q" placeholder="Search"><button>Go</button></form>')
        pages[f"/{slug}.html"] = f"<!doctype html><html><head><title>{title}</title></head><body>{''.join(body)}</body></html>"
    return pages


# ---- the video ---------------------------------------------------------------------------------

COLOURS = {"red": (200, 40, 40), "green": (40, 170, 60), "blue": (40, 70, 200), "yellow": (220, 200, 40),
           "purple": (140, 50, 170), "teal": (30, 160, 160), "orange": (240, 140, 30), "grey": (120, 120, 120),
           "brown": (120, 80, 40), "pink": (230, 120, 170), "navy": (20, 30, 90), "olive": (120, 130, 40)}
SCENE_SECONDS = 4


def write_video(path: str | Path, seconds: int, fps: int = 4, size: tuple[int, int] = (96, 64)) -> Path:
    """An mp4 (libx264) of scenes of `SCENE_SECONDS` seconds: scene i has background colour i (of
    `COLOURS`, in order) and a white square that crosses the frame from left to right."""
    import av

    width, height = size
    names = list(COLOURS)
    with av.open(str(path), "w") as out:
        stream = out.add_stream("libx264", rate=fps)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        stream.options = {"g": str(fps), "crf": "10"}
        for i in range(seconds * fps):
            scene, phase = divmod(i, SCENE_SECONDS * fps)
            frame = np.empty((height, width, 3), dtype=np.uint8)
            frame[:] = COLOURS[names[scene % len(names)]]
            side = height // 4
            x = int(phase / (SCENE_SECONDS * fps - 1) * (width - side))
            y = height // 4 if scene % 2 == 0 else height // 2
            frame[y:y + side, x:x + side] = 255
            for packet in stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
                out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)
    return Path(path)


def describe_frame(image: Any) -> str:
    """A frame in words: the nearest named background colour, and where a white square is."""
    pixels = np.asarray(image.convert("RGB"), dtype=np.float64)
    white = (pixels > 215).all(-1)
    rest = pixels[~white] if (~white).any() else pixels.reshape(-1, 3)
    mean = rest.reshape(-1, 3).mean(0)
    colour = min(COLOURS, key=lambda c: float(((mean - np.array(COLOURS[c])) ** 2).sum()))
    if not white.any():
        return f"{colour} background, nothing else"
    ys, xs = np.nonzero(white)
    h, w = white.shape
    row = "upper" if ys.mean() < h / 2 else "lower"
    col = ["left", "centre", "right"][min(2, int(3 * xs.mean() / w))]
    return f"{colour} background, a white square at the {row} {col}"


class FramesAsText:
    """A video environment whose observations carry their frames as text (one line per frame:
    timestamp and `describe_frame`) instead of pixels, for a text-only model. Actions, labels and
    meta (segment, start, end) are the wrapped environment's."""

    def __init__(self, env: Any) -> None:
        self.env, self.name = env, env.name

    def reset(self) -> Any:
        return self._as_text(self.env.reset())

    def actions(self) -> dict[str, str]:
        return self.env.actions()

    def act(self, action: dict[str, Any]) -> Any:
        return self._as_text(self.env.act(action))

    def close(self) -> None:
        self.env.close()

    @staticmethod
    def _as_text(obs: Any) -> Any:
        from agents.base import Observation

        head = obs.text.replace("No captions or transcript: the frames are the content.", "").strip()
        lines = [f"{t:.1f} s: {describe_frame(image)}" for image, t in zip(obs.images, obs.timestamps)]
        return Observation(label=obs.label, text=head + "\nFrames:\n" + "\n".join(lines), meta=obs.meta)
