"""An offline Geometry3K-style problem generator: PIL diagrams, exact answers, four choices.

    python -m common.synthetic --out data/synthetic --n 200 --seed 0 [--split train]
                               [--image-size 224 | --image-size 112,224] [--families a,b]

writes `OUT/{split}-00000-of-00001.parquet` in the public dataset's schema, which
`common.data.load_split` reads: `problem` ("<image>Find x."), `answer` (str: "70", "5\\sqrt{2}",
"12.5"), `images` (one `{"bytes": PNG, "path": None}`), `choices` (4 str), plus a `meta` column (a
JSON string: the family and the numbers drawn, from which the answer can be re-derived; the
loader ignores it). The file carries the Hugging Face feature metadata, so `datasets` reads the
images as images too.

Every number the answer needs is drawn in the image, never written in the text. Families
(`FAMILIES`): a triangle's third angle; parallel lines cut by a transversal (corresponding,
alternate, co-interior, vertical, linear-pair angles); a central / inscribed angle on the same
arc; a right triangle's third side (Pythagorean triples or a simplified radical); an isosceles
triangle's base or apex angle; a rectangle's area (half-integer sides give answers like 12.5).

Deterministic: problem i is drawn from `np.random.default_rng([seed, i])`, so a rerun writes the
same bytes and the first k problems do not depend on n. No two problems of a split have the same
text over the same pixels (`common.dedup.content_key`), nor one of another split given as
`exclude`: such a problem is drawn again from `default_rng([seed, i, k])`, k = 1, 2, ... `image_size` is one size ("224", square)
or a range "112,224" from which each problem draws its width and height (so batches mix sizes).
Tiny sizes (56) work; their labels are just hard to read. About 200 problems a second or more.
"""

from __future__ import annotations

import argparse
import functools
import io
import json
import math
import time
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np
from PIL import Image, ImageDraw, ImageFont

GEOMETRY = ("triangle_angles", "parallel_lines", "circle_angles", "right_triangle", "isosceles",
            "rectangle_area")
# Answerable from the pixels alone, with the four choices in their natural order (the CPU
# default's tiny model can learn these in a minute; it cannot learn geometry).
PERCEPTION = ("polygon_sides", "right_angle", "longest_segment")
FAMILIES = GEOMETRY + PERCEPTION
QUESTIONS = {"polygon_sides": "How many sides does the polygon have?",
             "right_angle": "Which of the numbered angles is a right angle?",
             "longest_segment": "Which of the labelled segments is the longest?"}
ROUND_NOTE = " Round to the nearest tenth if necessary."
_FIND_X = ("Find x.", "Find the value of x.", "Solve for x.")
_HF_FEATURES = {"problem": {"dtype": "string", "_type": "Value"},
                "answer": {"dtype": "string", "_type": "Value"},
                "images": {"feature": {"_type": "Image"}, "_type": "List"},
                "choices": {"feature": {"dtype": "string", "_type": "Value"}, "_type": "List"},
                "meta": {"dtype": "string", "_type": "Value"}}


# ---- numbers as Geometry3K writes them -------------------------------------------------------

def fmt_num(v: float) -> str:
    """70.0 -> '70', 12.5 -> '12.5' (one decimal at most)."""
    r = round(float(v), 1)
    return str(int(round(r))) if r == int(round(r)) else f"{r:.1f}"


def fmt_sqrt(n: int) -> str:
    """The exact square root of a positive integer: 50 -> '5\\sqrt{2}', 41 -> '\\sqrt{41}', 25 -> '5'."""
    k = max(f for f in range(1, math.isqrt(n) + 1) if n % (f * f) == 0)
    m = n // (k * k)
    if m == 1:
        return str(k)
    return f"{k}\\sqrt{{{m}}}" if k > 1 else f"\\sqrt{{{m}}}"


def parse_image_size(spec: int | str | Sequence[int]) -> tuple[int, int]:
    """(lo, hi) pixels from 224, "224", "112,224" or (112, 224)."""
    if isinstance(spec, str):
        spec = [int(s) for s in spec.replace(" ", "").split(",") if s]
    if isinstance(spec, (int, np.integer)):
        spec = [int(spec)]
    lo, hi = (int(spec[0]), int(spec[-1]))
    if not 16 <= lo <= hi or len(spec) > 2:
        raise ValueError(f"image size must be N or LO,HI with 16 <= LO <= HI, got {spec!r}")
    return lo, hi


# ---- drawing ---------------------------------------------------------------------------------

@functools.lru_cache(maxsize=32)
def _font(px: int) -> ImageFont.FreeTypeFont:
    return ImageFont.load_default(size=px)


def _unit(v) -> np.ndarray:
    v = np.asarray(v, float)
    return v / np.linalg.norm(v)


def _polar(deg: float, r: float = 1.0) -> np.ndarray:
    return r * np.array([math.cos(math.radians(deg)), math.sin(math.radians(deg))])


def _label_dist(angle_deg: float) -> float:
    """How far (in font sizes) from a vertex an angle's label sits: farther in narrow angles."""
    return min(2.8, 0.8 + 0.6 / math.sin(math.radians(angle_deg) / 2))


class _Canvas:
    """A white image plus a map from figure coordinates (math axes, y up) to pixels: the figure
    is rotated by `rot` degrees (mirrored first if `flip`) and scaled to fit `points` inside
    margins that leave room for labels (`pad` font sizes)."""

    def __init__(self, w: int, h: int, points, rot: float = 0.0, flip: bool = False,
                 pad: float = 1.6):
        self.w, self.h = w, h
        s = min(w, h)
        self.fs = max(7, round(s / 12))
        self.lw = max(1, round(s / 112))
        self.img = Image.new("RGB", (w, h), "white")
        self.draw = ImageDraw.Draw(self.img)
        self.font = _font(self.fs)
        c, n = math.cos(math.radians(rot)), math.sin(math.radians(rot))
        self.rot = np.array([[c, -n], [n, c]]) @ np.diag([-1.0 if flip else 1.0, 1.0])
        pts = np.asarray(points, float) @ self.rot.T
        lo, hi = pts.min(0), pts.max(0)
        m = max(0.08 * s, pad * self.fs)
        span = np.maximum(hi - lo, 1e-9)
        self.scale = min((w - 2 * m) / span[0], (h - 2 * m) / span[1])
        self.mid = (lo + hi) / 2

    def pt(self, p) -> np.ndarray:
        q = (self.rot @ np.asarray(p, float) - self.mid) * self.scale
        return np.array([self.w / 2 + q[0], self.h / 2 - q[1]])

    def dir(self, v) -> np.ndarray:
        """A figure direction as a unit vector in pixel space (y down)."""
        q = self.rot @ np.asarray(v, float)
        return _unit([q[0], -q[1]])

    def line(self, a, b, pixels: bool = False) -> None:
        a, b = (a, b) if pixels else (self.pt(a), self.pt(b))
        self.draw.line([tuple(a), tuple(b)], fill="black", width=self.lw)

    def polygon(self, pts) -> None:
        for a, b in zip(pts, pts[1:] + pts[:1]):
            self.line(a, b)

    def text(self, at, s: str) -> None:
        """Text centred at pixel `at`, pulled inside the image if it would stick out."""
        l, t, r, b = self.font.getbbox(s, anchor="mm")
        x = min(max(at[0], 1 - l), self.w - 1 - r)
        y = min(max(at[1], 1 - t), self.h - 1 - b)
        self.draw.text((x, y), s, fill="black", font=self.font, anchor="mm")

    def angle_label(self, vertex, ray1, ray2, angle_deg: float, s: str) -> None:
        """Mark the angle at figure point `vertex` between figure vectors `ray1` and `ray2`
        (less than 180 degrees) with a small arc, and write `s` inside it on its bisector, no
        farther than half the shorter ray."""
        p, d1, d2 = self.pt(vertex), self.dir(ray1), self.dir(ray2)
        shorter = min(np.linalg.norm(ray1), np.linalg.norm(ray2)) * self.scale
        dist = min(_label_dist(angle_deg), 0.5 * shorter / self.fs)
        r = self.fs * min(0.6, dist / 3)
        a1, a2 = (math.degrees(math.atan2(d[1], d[0])) for d in (d1, d2))
        if (a2 - a1) % 360 > 180:  # PIL draws clockwise (in pixels) from start to end
            a1, a2 = a2, a1
        self.draw.arc([p[0] - r, p[1] - r, p[0] + r, p[1] + r], a1, a2, fill="black", width=1)
        self.text(p + _unit(d1 + d2) * self.fs * dist, s)

    def side_label(self, a, b, inside, s: str) -> None:
        """Label side ab on the side away from figure point `inside`."""
        pa, pb, pi = self.pt(a), self.pt(b), self.pt(inside)
        mid = (pa + pb) / 2
        normal = _unit([pa[1] - pb[1], pb[0] - pa[0]])
        if np.dot(normal, mid - pi) < 0:
            normal = -normal
        l, t, r, b = self.font.getbbox(s, anchor="mm")  # clear the side by the text's extent
        reach = abs(normal[0]) * (r - l) / 2 + abs(normal[1]) * (b - t) / 2
        self.text(mid + normal * (self.fs * 0.4 + reach), s)

    def tick(self, a, b) -> None:
        """A congruence tick across the middle of side ab."""
        pa, pb = self.pt(a), self.pt(b)
        mid, n = (pa + pb) / 2, _unit([pa[1] - pb[1], pb[0] - pa[0]]) * self.fs * 0.35
        self.line(mid - n, mid + n, pixels=True)

    def png(self) -> bytes:
        buf = io.BytesIO()
        self.img.save(buf, format="PNG")
        return buf.getvalue()


# ---- families: each draws one problem; returns (canvas, text, answer, distractors, meta) -------

def _triangle_angles(rng, w, h):
    a = int(rng.integers(25, 101))
    b = int(rng.integers(25, 156 - a))
    angles = [a, b, 180 - a - b]  # at P0, P1, P2
    p = [np.zeros(2), np.array([1.0, 0.0]),
         _polar(a, math.sin(math.radians(b)) / math.sin(math.radians(angles[2])))]
    cv = _Canvas(w, h, p, rot=rng.uniform(0, 360), flip=bool(rng.integers(2)))
    cv.polygon(p)
    u = int(rng.integers(3))
    for k in range(3):
        cv.angle_label(p[k], p[(k + 1) % 3] - p[k], p[(k + 2) % 3] - p[k], angles[k],
                       "x°" if k == u else f"{angles[k]}°")
    g = [angles[k] for k in range(3) if k != u]
    ans = angles[u]
    cands = [180 - g[0], 180 - g[1], g[0] + g[1], abs(g[0] - g[1]), 90 - ans, ans + 10]
    meta = {"angles": angles, "unknown": u, "given": g}
    return cv, str(rng.choice(_FIND_X)), str(ans), cands, meta


_SECTORS = ("UR", "UL", "LL", "LR")  # around an intersection, counterclockwise from the right


def _parallel_lines(rng, w, h):
    a = int(rng.choice(np.r_[35:81, 100:146]))
    gi, gs = int(rng.integers(2)), int(rng.integers(4))
    uj, ut = gi, gs
    while (uj, ut) == (gi, gs):
        uj, ut = int(rng.integers(2)), int(rng.integers(4))
    theta = a if gs % 2 == 0 else 180 - a  # the transversal's angle to the lines
    ans = a if gs % 2 == ut % 2 else 180 - a
    cross = [np.array([y * math.cos(math.radians(theta)) / math.sin(math.radians(theta)), y])
             for y in (1.0, -1.0)]
    xs = [c[0] for c in cross]
    ends = [(np.array([min(xs) - 1.6, y]), np.array([max(xs) + 1.6, y])) for y in (1.0, -1.0)]
    up = _polar(theta)
    trans = (cross[0] + 0.9 * up, cross[1] - 0.9 * up)
    cv = _Canvas(w, h, [*ends[0], *ends[1], *trans], rot=rng.uniform(-30, 30))
    for (e0, e1), c in zip(ends, cross):
        cv.line(e0, e1)
        # the parallel-lines arrowhead, on the side of the line away from its intersection
        at = e1 - (0.5, 0.0) if c[0] <= sum(xs) / 2 else e0 + (0.8, 0.0)
        tip, d = cv.pt(at), cv.dir([1.0, 0.0]) * cv.fs * 0.4
        n = np.array([-d[1], d[0]])
        cv.line(tip - d + n, tip, pixels=True)
        cv.line(tip - d - n, tip, pixels=True)
    cv.line(*trans)
    named = int(rng.integers(2))
    name = str(int(rng.integers(1, 9)))
    for (i, s), lab in (((gi, gs), f"{a}°"), ((uj, ut), name if named else "x°")):
        bounds = (0, theta, 180, 180 + theta, 360)  # the rays around an intersection
        cv.angle_label(cross[i], _polar(bounds[s], 2.0), _polar(bounds[s + 1], 2.0),
                       bounds[s + 1] - bounds[s], lab)
    text = f"Find m \\angle {name}." if named else str(rng.choice(_FIND_X))
    cands = [180 - ans, abs(90 - ans), ans + 10, ans - 10, 2 * ans]
    meta = {"theta": theta, "given_pos": [gi, _SECTORS[gs]], "unknown_pos": [uj, _SECTORS[ut]],
            "given": [a]}
    return cv, text, str(ans), cands, meta


def _circle_angles(rng, w, h):
    variant = int(rng.integers(2))  # 0: central given, inscribed asked; 1: the reverse
    central = int(rng.integers(40, 161)) if variant == 0 else 2 * int(rng.integers(20, 81))
    alpha = rng.uniform(0, 360)
    A, B = _polar(alpha), _polar(alpha + central)
    C = _polar(alpha + central + (360 - central) * rng.uniform(0.3, 0.7))
    cv = _Canvas(w, h, [(-1, -1), (1, 1)])
    o, r = cv.pt((0, 0)), cv.scale
    cv.draw.ellipse([o[0] - r, o[1] - r, o[0] + r, o[1] + r], outline="black", width=cv.lw)
    d = max(1.5, cv.lw * 1.5)
    cv.draw.ellipse([o[0] - d, o[1] - d, o[0] + d, o[1] + d], fill="black")
    for p, q in ((np.zeros(2), A), (np.zeros(2), B), (C, A), (C, B)):
        cv.line(p, q)
    for p, s in ((A, "A"), (B, "B"), (C, "C")):
        cv.text(cv.pt(p) + cv.dir(p) * cv.fs * 0.8, s)
    labels = (f"{central}°", "x°") if variant == 0 else ("x°", f"{central // 2}°")
    cv.angle_label((0, 0), A, B, central, labels[0])
    cv.angle_label(C, A - C, B - C, central / 2, labels[1])
    if variant == 0:
        ans, g = central / 2, central
        cands = [central, 180 - central / 2, 90 - central / 2, central / 2 + 10, 2 * central]
    else:
        ans, g = central, central // 2
        cands = [g, g / 2, 180 - central, 360 - central, 180 - g]
    text = "Find x." + (ROUND_NOTE if ans != int(ans) else "")
    meta = {"variant": ["central_given", "inscribed_given"][variant], "central": central,
            "given": [g]}
    return cv, text, fmt_num(ans), [fmt_num(c) for c in cands], meta


_TRIPLES = ((3, 4, 5), (5, 12, 13), (8, 15, 17), (7, 24, 25), (20, 21, 29), (9, 40, 41))


def _right_triangle(rng, w, h):
    ask_hyp = bool(rng.integers(2))
    if rng.random() < 0.5:  # integer answer
        t = _TRIPLES[int(rng.integers(len(_TRIPLES)))]
        k = int(rng.integers(1, max(2, 40 // t[2]) + 1))
        p, q, c2 = t[0] * k, t[1] * k, (t[2] * k) ** 2
        if rng.integers(2):
            p, q = q, p
    else:  # a radical answer such as 5\sqrt{2}
        while True:
            p, q = int(rng.integers(2, 13)), int(rng.integers(2, 13))
            c2 = p * p + q * q
            if math.isqrt(c2) ** 2 != c2 or not ask_hyp:
                break
        if not ask_hyp:  # given the hypotenuse c (an integer) and leg p, find the leg q
            c = int(rng.integers(p + 1, p + 9))
            c2, q = c * c, math.sqrt(c * c - p * p)
    O, X, Y = np.zeros(2), np.array([float(p), 0.0]), np.array([0.0, float(q)])
    cv = _Canvas(w, h, [O, X, Y], rot=rng.uniform(0, 360), flip=bool(rng.integers(2)), pad=2.0)
    cv.polygon([O, X, Y])
    o, s = cv.pt(O), cv.fs * 0.6
    ex, ey = cv.dir([1, 0]) * s, cv.dir([0, 1]) * s
    cv.line(o + ex, o + ex + ey, pixels=True)  # the right-angle mark
    cv.line(o + ey, o + ex + ey, pixels=True)
    cen = (O + X + Y) / 3
    c = math.isqrt(c2)
    if ask_hyp:
        q = int(q)
        labels, ans, sq = (str(p), str(q), "x"), fmt_sqrt(c2), c2
        cands = [fmt_sqrt(abs(p * p - q * q)) if p != q else str(2 * p), str(p + q),
                 fmt_sqrt(c2 + p), fmt_sqrt(c2 + 2 * q), fmt_sqrt(2 * c2)]
        g = [p, q]
    else:
        sq = c2 - p * p
        labels, ans = (str(p), "x", str(c)), fmt_sqrt(sq)
        cands = [fmt_sqrt(c2 + p * p), str(c - p), fmt_sqrt(sq + c), fmt_sqrt(2 * sq),
                 fmt_sqrt(sq + 2 * p)]
        g = [p, c]
    for (a, b), lab in zip(((O, X), (O, Y), (X, Y)), labels):
        cv.side_label(a, b, cen, lab)
    meta = {"ask": "hypotenuse" if ask_hyp else "leg", "leg": p, "other_sq": int(round(q * q)),
            "hyp_sq": c2, "given": g, "answer_sq": sq}
    return cv, str(rng.choice(_FIND_X)), ans, cands, meta


def _isosceles(rng, w, h):
    variant = int(rng.integers(2))  # 0: apex given, base angle asked; 1: the reverse
    if variant == 0:
        apex = int(rng.integers(30, 111))
        base = (180 - apex) / 2
    else:
        base = int(rng.integers(35, 76))
        apex = 180 - 2 * base
    B1, B2 = np.array([-1.0, 0.0]), np.array([1.0, 0.0])
    A = np.array([0.0, math.tan(math.radians(base))])
    cv = _Canvas(w, h, [B1, B2, A], rot=rng.uniform(-25, 25))
    cv.polygon([B1, B2, A])
    cv.tick(A, B1)
    cv.tick(A, B2)
    Bk = B1 if rng.integers(2) else B2
    apex_lab, base_lab = (f"{apex}°", "x°") if variant == 0 else ("x°", f"{base}°")
    cv.angle_label(A, B1 - A, B2 - A, apex, apex_lab)
    cv.angle_label(Bk, A - Bk, -Bk, base, base_lab)
    if variant == 0:
        ans, g, cands = base, apex, [180 - apex, apex, 90 - apex / 2 + 10, 180 - base]
    else:
        ans, g, cands = apex, base, [180 - base, base, 90 - base, 2 * base]
    text = "Find x." + (ROUND_NOTE if ans != int(ans) else "")
    meta = {"variant": ["apex_given", "base_given"][variant], "given": [g]}
    return cv, text, fmt_num(ans), [fmt_num(c) for c in cands], meta


def _rectangle_area(rng, w, h):
    a = int(rng.integers(3, 21))
    b = int(rng.integers(2, 16))
    b = b + 0.5 if rng.random() < 0.3 else b
    unit = str(rng.choice(["", " cm", " in.", " ft", " m"]))
    P = [np.zeros(2), np.array([a, 0.0]), np.array([a, b]), np.array([0.0, b])]
    cv = _Canvas(w, h, P, rot=rng.uniform(-15, 15), pad=3.4 if unit else 2.2)
    cv.polygon(P)
    cen = np.array([a / 2, b / 2])
    cv.side_label(P[0], P[1], cen, fmt_num(a) + unit)
    cv.side_label(P[1], P[2], cen, fmt_num(b) + unit)
    ans = a * b
    text = ("Find the area of the rectangle." if b == int(b)
            else "Find the area of the figure." + ROUND_NOTE)
    cands = [2 * (a + b), a + b, ans / 2, ans + a, ans - b]
    meta = {"sides": [a, b], "given": [a, b]}
    return cv, text, fmt_num(ans), [fmt_num(c) for c in cands], meta


def _polygon_sides(rng, w, h):
    n = int(rng.integers(3, 7))
    start = rng.uniform(0, 360)
    p = [_polar(start + 360 * k / n + rng.uniform(-8, 8), rng.uniform(0.85, 1.0))
         for k in range(n)]
    cv = _Canvas(w, h, [(-1, -1), (1, 1)], pad=0.5)
    cv.draw.polygon([tuple(cv.pt(q)) for q in p], fill=(200, 200, 200), outline="black",
                    width=cv.lw)
    meta = {"sides": n, "given": []}
    return cv, QUESTIONS["polygon_sides"], str(n), ["3", "4", "5", "6"], meta


def _right_angle(rng, w, h):
    right = int(rng.integers(4))
    others = rng.permutation([int(rng.integers(30, 61)), int(rng.integers(35, 66)),
                              int(rng.integers(120, 151))])
    angles = [90 if k == right else int(others[k - (k > right)]) for k in range(4)]
    cells = [np.array([x, y]) for y in (1.3, 0.0) for x in (0.0, 1.6)]  # reading order
    pts = [c + d for c in cells for d in ((0, 0), (1, 0), (0, 1), (-0.4, 1))]
    cv = _Canvas(w, h, pts, pad=0.6)
    for k, (c, a) in enumerate(zip(cells, angles)):
        v = c + (0.45 if a > 90 else 0.0, 0.0)
        ray = _polar(a, 0.95)
        cv.line(v, v + (0.95, 0.0))
        cv.line(v, v + ray)
        o, s = cv.pt(v), cv.fs * 0.5
        if a == 90:  # the right-angle square
            ex, ey = cv.dir([1, 0]) * s, cv.dir([0, 1]) * s
            cv.line(o + ex, o + ex + ey, pixels=True)
            cv.line(o + ey, o + ex + ey, pixels=True)
        else:
            r = s
            cv.draw.arc([o[0] - r, o[1] - r, o[0] + r, o[1] + r], -a, 0, fill="black", width=1)
        cv.text(cv.pt(v + _polar(a / 2, 0.35)), str(k + 1))
    meta = {"angles": angles, "given": []}
    return cv, QUESTIONS["right_angle"], str(right + 1), ["1", "2", "3", "4"], meta


def _longest_segment(rng, w, h):
    longest = int(rng.integers(4))
    lengths = [1.0 if k == longest else float(rng.uniform(0.3, 0.7)) for k in range(4)]
    starts = [float(rng.uniform(0.0, 0.1)) for _ in range(4)]
    cv = _Canvas(w, h, [(-0.2, 0.0), (1.15, 1.2)], pad=0.6)
    for k, (x0, n) in enumerate(zip(starts, lengths)):
        y = 1.2 - 0.4 * k  # a at the top, d at the bottom
        cv.line((x0, y), (x0 + n, y))
        for x in (x0, x0 + n):  # end points
            q, d = cv.pt((x, y)), max(1.5, cv.lw * 1.5)
            cv.draw.ellipse([q[0] - d, q[1] - d, q[0] + d, q[1] + d], fill="black")
        cv.text(cv.pt((x0 - 0.12, y)), "abcd"[k])
    meta = {"lengths": [round(n, 3) for n in lengths], "given": []}
    return cv, QUESTIONS["longest_segment"], "abcd"[longest], list("abcd"), meta


_DRAW = {"triangle_angles": _triangle_angles, "parallel_lines": _parallel_lines,
         "circle_angles": _circle_angles, "right_triangle": _right_triangle,
         "isosceles": _isosceles, "rectangle_area": _rectangle_area,
         "polygon_sides": _polygon_sides, "right_angle": _right_angle,
         "longest_segment": _longest_segment}


_CAPTIONS = {"polygon_sides": "sides: {}", "right_angle": "right angle: {}",
             "longest_segment": "longest: {}"}


def caption(family: str, answer: str) -> str:
    """What a perception figure shows, in words ending with its answer (not a choice letter):
    caption("polygon_sides", "5") -> "sides: 5" (the tiny checkpoint's vision pretraining)."""
    return _CAPTIONS[family].format(answer)


def problem_kind(problem: str) -> str:
    """The perception family a problem text asks (`QUESTIONS`), else "geometry"."""
    text = problem.replace("<image>", "").strip()
    return next((f for f, q in QUESTIONS.items() if text == q), "geometry")


# ---- problems, rows, files -------------------------------------------------------------------

def _square_of(s: str) -> int:
    """'5\\sqrt{2}' -> 50, '\\sqrt{41}' -> 41, '7' -> 49."""
    k, _, m = s.partition("\\sqrt{")
    return (int(k) if k else 1) ** 2 * (int(m.rstrip("}")) if m else 1)


def _is_positive(s: str) -> bool:
    return "\\sqrt" in s or float(s) > 0


def _choices(rng, answer: str, candidates: Sequence) -> list[str]:
    """The answer and 3 distinct distractors (3 of the candidates, then neighbours of the answer:
    value + 1, + 2, ... for numbers, radicand + 1, + 2, ... for radicals), in a seeded order."""
    pool = [c for c in dict.fromkeys(str(c) for c in candidates)
            if c != answer and _is_positive(c)]
    picked = [pool[i] for i in sorted(rng.permutation(len(pool))[:3])]
    radical = "\\sqrt" in answer
    step = 1
    while len(picked) < 3:
        extra = fmt_sqrt(_square_of(answer) + step) if radical else fmt_num(float(answer) + step)
        if extra not in picked and extra != answer:
            picked.append(extra)
        step += 1
    out = [answer, *picked]
    return [out[i] for i in rng.permutation(4)]


def make_problem(seed: int, index: int, image_size: int | str | Sequence[int] = 224,
                 families: Sequence[str] = FAMILIES, attempt: int = 0) -> dict:
    """Problem `index` of the set seeded by `seed`, as a row dict (see the module docstring);
    `attempt` k > 0 draws it again from `default_rng([seed, index, k])` (`distinct_problem`)."""
    rng = np.random.default_rng([seed, index] + ([attempt] if attempt else []))
    lo, hi = parse_image_size(image_size)
    w, h = (lo, lo) if lo == hi else (int(rng.integers(lo, hi + 1)), int(rng.integers(lo, hi + 1)))
    family = families[int(rng.integers(len(families)))]
    cv, text, answer, cands, meta = _DRAW[family](rng, w, h)
    meta = {"family": family, "size": [w, h], **meta} | ({"attempt": attempt} if attempt else {})
    choices = cands if family in PERCEPTION else _choices(rng, answer, cands)
    return {"problem": "<image>" + text, "answer": answer,
            "images": [{"bytes": cv.png(), "path": None}],
            "choices": choices, "meta": json.dumps(meta, sort_keys=True)}


MAX_ATTEMPTS = 1000  # draws of one index before the families are taken to be exhausted


def row_key(row: dict) -> str:
    """`common.dedup.content_key` of a generated row, its images decoded as the loader does."""
    from common.data import MAX_IMAGE_PIXELS, decode_image
    from common.dedup import content_key

    return content_key(row["problem"], [decode_image(item, ".", MAX_IMAGE_PIXELS)
                                        for item in row["images"]])


def distinct_problem(seed: int, index: int, image_size: int | str | Sequence[int],
                     families: Sequence[str], taken: set[str], add: bool = True) -> dict:
    """`make_problem(seed, index, ...)`, drawn again (attempt 1, 2, ...) while its content key
    is in `taken`; the key it ends with is added to `taken` (unless not `add`)."""
    for attempt in range(MAX_ATTEMPTS):
        row = make_problem(seed, index, image_size, families, attempt)
        key = row_key(row)
        if key not in taken:
            if add:
                taken.add(key)
            return row
    raise ValueError(f"no problem of {list(families)} at image size {image_size} differs from "
                     f"the {len(taken)} already drawn after {MAX_ATTEMPTS} draws: ask for fewer "
                     "problems, more families or larger images")


def generate(n: int, seed: int, image_size: int | str | Sequence[int] = 224,
             families: Sequence[str] = FAMILIES, exclude: Iterable[str] = ()) -> list[dict]:
    """`n` problems as row dicts (problem, answer, images [{bytes, path}], choices, meta), no
    two with the same content key and none with a key in `exclude` (`distinct_problem`: a
    problem that would repeat one is drawn again, every other is problem i of the seed)."""
    unknown = set(families) - set(FAMILIES)
    if unknown or not families:
        raise ValueError(f"unknown families {sorted(unknown)}; choose from {FAMILIES}")
    taken = set(exclude)
    return [distinct_problem(seed, i, image_size, families, taken) for i in range(n)]


def split_keys(path: str | Path) -> set[str]:
    """The content keys of the problems in a parquet file written by `write_split`."""
    import pyarrow.parquet as pq

    table = pq.read_table(path, columns=["problem", "images"])
    return {row_key(row) for row in table.to_pylist()}


def write_split(out_dir: str | Path, split: str, n: int, seed: int,
                image_size: int | str | Sequence[int] = 224,
                families: Sequence[str] = FAMILIES, exclude: Iterable[str] = ()) -> Path:
    """Generate `n` distinct problems, none with a content key in `exclude` (`generate`), and
    write `out_dir/{split}-00000-of-00001.parquet`; returns it. Written to a temporary name
    first, so an interrupted run leaves no half file behind."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = generate(n, seed, image_size, families, exclude)
    image = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
    schema = pa.schema([("problem", pa.string()), ("answer", pa.string()),
                        ("images", pa.list_(image)), ("choices", pa.list_(pa.string())),
                        ("meta", pa.string())],
                       metadata={"huggingface": json.dumps({"info": {"features": _HF_FEATURES}})})
    table = pa.Table.from_pylist(rows, schema=schema)
    out = Path(out_dir) / f"{split}-00000-of-00001.parquet"
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp")
    pq.write_table(table, tmp, row_group_size=128)
    tmp.replace(out)
    return out


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, help="output directory")
    ap.add_argument("--n", type=int, default=200, help="number of problems")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--split", default="train")
    ap.add_argument("--image-size", default="224", help='pixels: "224" or a range "112,224"')
    ap.add_argument("--families", default=",".join(FAMILIES), help="comma-separated subset")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    path = write_split(args.out, args.split, args.n, args.seed, args.image_size,
                       tuple(args.families.split(",")))
    print(f"wrote {args.n} problems to {path} in {time.perf_counter() - t0:.2f} s")


if __name__ == "__main__":
    main()
