"""Document navigator: a PDF as an agent environment.

`PdfEnv(path)` opens the PDF with pypdfium2 and shows one page at a time: its text (for text
models) and, with `render=True`, the page rendered to a PIL image (for vision-language models).
Actions: next, previous, goto {"page": N} (1-based), search {"text": "..."} (the pages that contain
it, with a snippet each); "answer" and "recall" are the loop's. A page visited again has the same
content key, so the loop recalls its chunk instead of encoding it again.

Bad input is refused with what to do: a missing file, a file that is not a PDF, an encrypted or
damaged PDF, a PDF with no pages (`EnvError`); a page out of range or an empty search
(`ActionError`, the agent goes on).

`write_text_pdf(path, pages)` writes a plain text PDF (standard Helvetica font, one string per
page), the kind the tests and `agentwin demo` generate.

`SkimSearchDecider` is a heuristic navigation policy (no model): read the document front to back,
search for a phrase, go back to the first page that has it, then answer with a function of the
window (`agentwin demo` generates the answer with the model through the window).
"""

from __future__ import annotations

import math
import re
import textwrap
from pathlib import Path
from typing import Any, Callable

from agents.base import ActionError, EnvError, Observation


class PdfEnv:
    """One PDF, one page in view at a time; see the module docstring.

    render: also render pages to PIL images (for VLMs); `scale` is pdfium's (1.0 = 72 dpi), reduced
    so a page never exceeds `max_pixels`. max_chars: a page's text is cut to this length in the
    observation (search reads the whole text)."""

    name = "doc"

    def __init__(self, path: str | Path, render: bool = False, scale: float = 1.5,
                 max_pixels: int = 1280 * 28 * 28, max_chars: int = 4000, progress: bool = False) -> None:
        import pypdfium2 as pdfium

        self.path = Path(path)
        if not self.path.exists():
            raise EnvError(f"{self.path}: no such file; give the path of a PDF")
        if not self.path.is_file():
            raise EnvError(f"{self.path}: not a file; give the path of a PDF")
        with self.path.open("rb") as fh:
            head = fh.read(1024)
        if b"%PDF-" not in head:
            start = head[:16]
            raise EnvError(f"{self.path}: not a PDF (a PDF starts with '%PDF-', this file starts with {start!r}); "
                           "give a .pdf file")
        if not isinstance(max_chars, int) or max_chars < 1:
            raise ValueError(f"max_chars must be a positive int, got {max_chars!r}")
        if not scale > 0 or not max_pixels > 0:
            raise ValueError("scale and max_pixels must be positive")
        try:
            self._pdf = pdfium.PdfDocument(str(self.path))
        except pdfium.PdfiumError as err:
            if "password" in str(err).lower():
                raise EnvError(f"{self.path}: the PDF is encrypted; decrypt it first (e.g. `qpdf --decrypt in.pdf out.pdf`)") from err
            raise EnvError(f"{self.path}: the PDF is damaged and cannot be read ({err}); repair or re-export it") from err
        self.pages = len(self._pdf)
        if self.pages == 0:
            self._pdf.close()
            raise EnvError(f"{self.path}: the PDF has no pages")
        self.render, self.scale, self.max_pixels, self.max_chars = render, scale, max_pixels, max_chars
        self._text = [self._page_text(i) for i in _progress(range(self.pages), "reading pages", progress)]
        self.page = 1

    # ---- Env --------------------------------------------------------------------------------

    def reset(self) -> Observation:
        self.page = 1
        return self._observe(1)

    def actions(self) -> dict[str, str]:
        return {
            "next": "go to the next page",
            "previous": "go to the previous page",
            "goto": f'{{"page": N}} open page N (1 to {self.pages})',
            "search": '{"text": "..."} list the pages that contain the text',
        }

    def action_arguments(self) -> dict[str, dict[str, Any]]:
        """Argument schemas refining `actions()` for decoding under a schema (`agents.grammar`)."""
        return {"goto": {"page": {"type": "integer", "minimum": 1, "maximum": self.pages}}}

    def act(self, action: dict[str, Any]) -> Observation:
        name = action.get("action")
        if name == "next":
            if self.page >= self.pages:
                raise ActionError(f"already at the last page ({self.pages}); use previous, goto or answer")
            return self._go(self.page + 1)
        if name == "previous":
            if self.page <= 1:
                raise ActionError("already at the first page; use next, goto or answer")
            return self._go(self.page - 1)
        if name == "goto":
            return self._go(_page_number(action.get("page"), self.pages))
        if name == "search":
            return self._search(action.get("text", action.get("query")))
        raise ActionError(f"unknown action {name!r}; choose one of {', '.join(self.actions())}")

    def close(self) -> None:
        if getattr(self, "_pdf", None) is not None:
            self._pdf.close()
            self._pdf = None

    def __enter__(self) -> "PdfEnv":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ---- pages ------------------------------------------------------------------------------

    def page_text(self, page: int) -> str:
        """The full text of page `page` (1-based)."""
        return self._text[_page_number(page, self.pages) - 1]

    def _page_text(self, index: int) -> str:
        page = self._pdf[index]
        try:
            textpage = page.get_textpage()
            text = textpage.get_text_range()
            textpage.close()
        except Exception as err:  # pdfium reports damaged content streams this way
            raise EnvError(f"{self.path}: page {index + 1} cannot be read ({err}); the PDF is damaged") from err
        finally:
            page.close()
        return text.replace("\r\n", "\n").replace("\r", "\n").strip()

    def _render(self, index: int) -> Any:
        page = self._pdf[index]
        try:
            width, height = page.get_size()
            scale = min(self.scale, math.sqrt(self.max_pixels / max(width * height, 1.0)))
            while math.ceil(width * scale) * math.ceil(height * scale) > self.max_pixels:
                scale *= 0.99  # pdfium rounds the bitmap size up
            return page.render(scale=scale).to_pil().convert("RGB")
        finally:
            page.close()

    def _go(self, page: int) -> Observation:
        self.page = page
        return self._observe(page)

    def _observe(self, page: int) -> Observation:
        text = self._text[page - 1]
        if len(text) > self.max_chars:
            text = text[: self.max_chars] + f"\n[... page text cut at {self.max_chars} characters]"
        if not text:
            text = "[this page has no text layer]"
        images = (self._render(page - 1),) if self.render else ()
        return Observation(label=f"page {page}/{self.pages}", text=text, images=images, meta={"page": page})

    def _search(self, query: Any) -> Observation:
        if not isinstance(query, str) or not query.strip():
            raise ActionError('search needs a non-empty "text", e.g. {"action": "search", "text": "harbour"}')
        needle = " ".join(query.split()).lower()
        hits = []
        for index, text in enumerate(self._text):
            flat = " ".join(text.split())
            at = flat.lower().find(needle)
            if at >= 0:
                snippet = flat[max(0, at - 40): at + len(needle) + 40]
                hits.append(f"page {index + 1}: ...{snippet}...")
        label = f"search {query.strip()!r}"
        if not hits:
            return Observation(label=label, text=f"No page contains {query.strip()!r}.", meta={"pages": []})
        pages = [int(re.match(r"page (\d+)", h).group(1)) for h in hits]
        body = f"Pages containing {query.strip()!r}: {', '.join(map(str, pages))}\n" + "\n".join(hits[:5])
        return Observation(label=label, text=body, meta={"pages": pages})


def _page_number(raw: Any, pages: int) -> int:
    if isinstance(raw, bool):
        raw = None
    try:
        page = int(raw)
    except (TypeError, ValueError):
        raise ActionError(f'goto needs a page number, e.g. {{"action": "goto", "page": 2}}; got {raw!r}') from None
    if not 1 <= page <= pages:
        raise ActionError(f"page {page} is out of range; the document has pages 1 to {pages}")
    return page


def _progress(items: Any, desc: str, enabled: bool) -> Any:
    """A progress bar on a terminal only: in a log or a pipe it would leave carriage returns and
    cursor moves behind."""
    import sys

    from tqdm.auto import tqdm

    return tqdm(items, desc=desc, disable=not (enabled and sys.stderr.isatty()), leave=False)


# ---- a plain text PDF writer ------------------------------------------------------------------

def write_text_pdf(path: str | Path, pages: list[str], font_size: int = 11, width_chars: int = 88) -> Path:
    """Write `pages` (one string each; blank lines kept) as a Letter-size PDF with the standard
    Helvetica font, text extractable by any PDF reader. Characters outside Latin-1 become '?'."""
    if not pages or not all(isinstance(p, str) for p in pages):
        raise ValueError("pages must be a non-empty list of strings")
    leading = font_size + 3
    objects: list[bytes] = []  # object n is objects[n - 1]

    def add(body: bytes) -> int:
        objects.append(body)
        return len(objects)

    catalog = add(b"")  # filled in below
    tree = add(b"")
    font = add(b"<< /Type /Font /Subtype /Type1 /BaseFont /Helvetica /Encoding /WinAnsiEncoding >>")
    kids = []
    for text in pages:
        lines = []
        for paragraph in text.split("\n"):
            lines.extend(textwrap.wrap(paragraph, width_chars) or [""])
        ops = [f"BT /F1 {font_size} Tf {leading} TL 56 {792 - 60} Td".encode()]
        for line in lines[: (792 - 100) // leading]:
            escaped = line.encode("latin-1", "replace").replace(b"\\", b"\\\\").replace(b"(", b"\\(").replace(b")", b"\\)")
            ops.append(b"(" + escaped + b") Tj T*")
        ops.append(b"ET")
        stream = b"\n".join(ops)
        content = add(b"<< /Length %d >>\nstream\n" % len(stream) + stream + b"\nendstream")
        kids.append(add(b"<< /Type /Page /Parent %d 0 R /MediaBox [0 0 612 792] /Contents %d 0 R "
                        b"/Resources << /Font << /F1 %d 0 R >> >> >>" % (tree, content, font)))
    objects[catalog - 1] = b"<< /Type /Catalog /Pages %d 0 R >>" % tree
    objects[tree - 1] = (b"<< /Type /Pages /Kids [" + b" ".join(b"%d 0 R" % k for k in kids)
                         + b"] /Count %d >>" % len(kids))
    out = bytearray(b"%PDF-1.4\n%\xe2\xe3\xcf\xd3\n")
    offsets = []
    for number, body in enumerate(objects, 1):
        offsets.append(len(out))
        out += b"%d 0 obj\n" % number + body + b"\nendobj\n"
    xref = len(out)
    out += b"xref\n0 %d\n0000000000 65535 f \n" % (len(objects) + 1)
    out += b"".join(b"%010d 00000 n \n" % o for o in offsets)
    out += b"trailer\n<< /Size %d /Root %d 0 R >>\nstartxref\n%d\n%%%%EOF\n" % (len(objects) + 1, catalog, xref)
    path = Path(path)
    path.write_bytes(bytes(out))
    return path


# ---- a heuristic navigation policy ------------------------------------------------------------

class SkimSearchDecider:
    """No model in the moves: skim every page in order, search for `phrase`, go to the first page
    found (the loop recalls it, since it was seen before), optionally recall an earlier step by
    number, then answer with `answer_fn(window)`. It follows the observations the loop shows it
    (`observe`), not the page text: the pages it read are in the window, for the answer."""

    def __init__(self, phrase: str, answer_fn: Callable[[Any], str], recall_step: int | None = None) -> None:
        if not isinstance(phrase, str) or not phrase.strip():
            raise ValueError("phrase must be a non-empty string")
        self.phrase, self.answer_fn, self.recall_step = phrase, answer_fn, recall_step
        self._stage = "skim"
        self._last: Observation | None = None

    def observe(self, obs: Observation) -> None:
        self._last = obs

    def decide(self, window: Any, prompt: str) -> str:
        import json

        meta = self._last.meta if self._last is not None else {}
        if self._stage == "skim":
            label = self._last.label if self._last is not None else ""
            at_end = re.fullmatch(r"page (\d+)/(\d+)", label)
            if at_end and at_end.group(1) != at_end.group(2):
                return json.dumps({"action": "next"})
            self._stage = "search"
            return json.dumps({"action": "search", "text": self.phrase})
        if self._stage == "search":
            self._stage = "recall" if self.recall_step is not None else "answer"
            if meta.get("pages"):
                return json.dumps({"action": "goto", "page": int(meta["pages"][0])})
        if self._stage == "recall":
            self._stage = "answer"
            return json.dumps({"action": "recall", "step": self.recall_step})
        return json.dumps({"action": "answer", "text": self.answer_fn(window)})
