// Usage per adapter and day (GET /v1/usage) as a stacked bar chart drawn in SVG, with the
// numbers of each bar on hover or keyboard focus, and the totals as a table.

import { call } from "./api.js";
import { field, h, svg, table } from "./dom.js";
import { count, utcDay } from "./format.js";

const COLORS = ["#3b6fd4", "#e07b39", "#2f9e6a", "#b8489b", "#c9a227", "#5a9bb0", "#8a6d3b", "#d64545"];
const SIZE = { width: 960, height: 320, left: 64, right: 16, top: 16, bottom: 48 };
const MEASURES = {
  requests: { label: "Requests", of: (r) => r.requests },
  tokens: { label: "Tokens", of: (r) => r.prompt_tokens + r.completion_tokens },
};
const BASE = "(base model)";

const DAY_MS = 86400000;
const MAX_DAYS = 366; // longer ranges are drawn one bar per month

/** The bars of a range: one per UTC day, or per month where it is longer than MAX_DAYS, from
 * the first to the last day asked for; `of(day)` is the bar a usage row's day falls in. */
export function buckets(start, end) {
  const first = new Date(`${start}T00:00:00Z`);
  const last = new Date(`${end}T00:00:00Z`);
  const keys = [];
  const monthly = (last - first) / DAY_MS + 1 > MAX_DAYS;
  if (monthly) {
    for (let d = new Date(Date.UTC(first.getUTCFullYear(), first.getUTCMonth(), 1)); d <= last; d.setUTCMonth(d.getUTCMonth() + 1)) {
      keys.push(d.toISOString().slice(0, 7));
    }
  } else {
    for (let d = new Date(first); d <= last; d.setUTCDate(d.getUTCDate() + 1)) keys.push(d.toISOString().slice(0, 10));
  }
  const years = new Set(keys.map((k) => k.slice(0, 4))).size > 1;
  return {
    unit: monthly ? "month" : "day",
    keys,
    start,
    end,
    of: (day) => (monthly ? day.slice(0, 7) : day),
    // a tick's text: the year where the range spans more than one, never a bare month number
    tick: (key) => (monthly || years ? key : key.slice(5)),
  };
}

/** The axis top: 5, 10, 20, 50, 100, ... at least `value` (so fifths are whole numbers). */
function niceMax(value) {
  if (value <= 5) return 5;
  const step = 10 ** Math.floor(Math.log10(value));
  for (const m of [1, 2, 5, 10]) if (m * step >= value) return m * step;
  return 10 * step;
}

function describe(row) {
  return (
    `${row.adapter || BASE} ${row.span}: ${count(row.requests)} requests, ` +
    `${count(row.prompt_tokens)} prompt + ${count(row.completion_tokens)} completion tokens`
  );
}

/** The usage rows summed per bar and adapter, each with the days it covers in words. */
function perBar(rows, range) {
  const byBar = new Map(range.keys.map((k) => [k, new Map()]));
  for (const r of rows) {
    const key = range.of(r.day);
    if (!byBar.has(key)) continue;
    const sums = byBar.get(key);
    const t = sums.get(r.adapter) || { adapter: r.adapter, day: key, requests: 0, prompt_tokens: 0, completion_tokens: 0 };
    t.requests += r.requests;
    t.prompt_tokens += r.prompt_tokens;
    t.completion_tokens += r.completion_tokens;
    sums.set(r.adapter, t);
  }
  const out = new Map();
  for (const [key, sums] of byBar) {
    let span = `on ${key}`;
    if (range.unit === "month") {
      const [y, m] = key.split("-").map(Number);
      const last = new Date(Date.UTC(y, m, 0)).toISOString().slice(0, 10);
      const from = `${key}-01` < range.start ? range.start : `${key}-01`;
      span = `from ${from} to ${last > range.end ? range.end : last}`;
    }
    const bar = [...sums.values()].sort((p, q) => p.adapter.localeCompare(q.adapter));
    for (const t of bar) t.span = span;
    out.set(key, bar);
  }
  return out;
}

/** The chart's width in pixels: what the page has for it (drawn 1:1, so 12 px text stays
 * 12 px on a phone), at most SIZE.width. */
function available() {
  const main = document.getElementById("main");
  const style = getComputedStyle(main);
  const inner = main.clientWidth - parseFloat(style.paddingLeft) - parseFloat(style.paddingRight);
  return Math.round(Math.min(SIZE.width, Math.max(280, inner - 18)));
}

function showTip(target, text) {
  const tip = document.getElementById("tooltip");
  tip.textContent = text;
  tip.hidden = false;
  // above the bar, kept inside the window (CSSOM positions: allowed by the CSP's style-src)
  const box = target.getBoundingClientRect();
  const half = tip.offsetWidth / 2 + 8;
  const width = document.documentElement.clientWidth; // without the scroll bar
  const center = Math.min(Math.max(box.left + box.width / 2, half), width - half);
  tip.style.left = `${Math.round(window.scrollX + center)}px`;
  tip.style.top = `${Math.round(window.scrollY + box.top - 8)}px`;
}

function hideTip() {
  document.getElementById("tooltip").hidden = true;
}

/** The chart: one stacked bar per day (or month), one segment per adapter, `width` px wide. */
export function chart(rows, range, measure, width = SIZE.width) {
  const { height, left, right, top, bottom } = SIZE;
  const of = MEASURES[measure].of;
  const adapters = [...new Set(rows.map((r) => r.adapter))].sort();
  const color = (a) => COLORS[adapters.indexOf(a) % COLORS.length];
  const byBar = perBar(rows, range);
  const max = niceMax(Math.max(0, ...[...byBar.values()].map((rs) => rs.reduce((n, r) => n + of(r), 0))));
  const plotH = height - top - bottom;
  const plotW = width - left - right;
  const slot = plotW / range.keys.length;
  const barW = Math.max(2, slot * 0.7);
  const y = (v) => top + plotH - (plotH * v) / max;

  const grid = [0, 0.2, 0.4, 0.6, 0.8, 1].map((f) =>
    svg(
      "g",
      { class: "grid" },
      svg("line", { x1: left, x2: width - right, y1: y(max * f), y2: y(max * f) }),
      svg("text", { x: left - 6, y: y(max * f) + 4, "text-anchor": "end" }, count(Math.round(max * f))),
    ),
  );
  // as many tick labels as fit side by side (12 px text: about 7 px a character, 16 px apart)
  const chars = range.tick(range.keys[0]).length;
  const every = Math.ceil(range.keys.length / Math.max(1, Math.floor(plotW / (chars * 7 + 16))));
  const bars = range.keys.map((key, i) => {
    let base = 0;
    const x = left + i * slot + (slot - barW) / 2;
    const segments = byBar.get(key).map((r) => {
      const value = of(r);
      const rect = svg(
        "rect",
        {
          class: "bar",
          x: x.toFixed(1),
          y: y(base + value).toFixed(1),
          width: barW.toFixed(1),
          height: Math.max(0, y(base) - y(base + value)).toFixed(1),
          fill: color(r.adapter),
          tabindex: "0",
          role: "img",
          "aria-label": describe(r),
          dataset: { adapter: r.adapter, day: r.day },
          on: {
            mouseenter: (e) => showTip(e.target, describe(r)),
            focus: (e) => showTip(e.target, describe(r)),
            mouseleave: hideTip,
            blur: hideTip,
          },
        },
        svg("title", {}, describe(r)),
      );
      base += value;
      return rect;
    });
    let label = null;
    if (i % every === 0) {
      const half = (chars * 7) / 2;
      const mid = x + barW / 2;
      const [at, anchor] = mid + half > width ? [width - 2, "end"] : mid - half < 0 ? [2, "start"] : [mid, "middle"];
      label = svg("text", { class: "tick", x: at.toFixed(1), y: height - bottom + 16, "text-anchor": anchor }, range.tick(key));
    }
    return svg("g", {}, segments, label);
  });
  const legend = h(
    "ul",
    { class: "legend", "aria-label": "Adapters" },
    adapters.map((a) => h("li", {}, svg("svg", { width: "12", height: "12", "aria-hidden": "true" }, svg("rect", { width: "12", height: "12", fill: color(a) })), ` ${a || BASE}`)),
  );
  const figure = svg(
    "svg",
    {
      class: "chart",
      width: String(width),
      viewBox: `0 0 ${width} ${height}`,
      role: "group",
      "aria-label": `${MEASURES[measure].label} per ${range.unit} and adapter, ${range.start} to ${range.end}`,
    },
    grid,
    bars,
    svg("text", { x: left, y: height - 8, class: "axis" }, `UTC ${range.unit}`),
  );
  return h("figure", { class: "usage" }, figure, h("figcaption", {}, legend));
}

function totals(rows) {
  const sums = new Map();
  for (const r of rows) {
    const t = sums.get(r.adapter) || { requests: 0, prompt: 0, completion: 0 };
    t.requests += r.requests;
    t.prompt += r.prompt_tokens;
    t.completion += r.completion_tokens;
    sums.set(r.adapter, t);
  }
  return [...sums.entries()]
    .sort(([a], [b]) => a.localeCompare(b))
    .map(([a, t]) => [a || BASE, count(t.requests), count(t.prompt), count(t.completion)]);
}

/** #/usage: the chart for a range of days (the last 14 by default). */
export async function view(app) {
  const start = h("input", { type: "date", value: utcDay(-13) });
  const end = h("input", { type: "date", value: utcDay(0) });
  const measure = h(
    "select",
    {},
    Object.entries(MEASURES).map(([key, m]) => h("option", { value: key }, m.label)),
  );
  const out = h("div", { id: "usage-out", "aria-live": "polite" });
  let shown = null; // what the chart shows, redrawn at the new width when the page's changes
  const draw = async () => {
    const from = start.value || utcDay(-13);
    const to = end.value || utcDay(0);
    const rows = await call("GET", `v1/usage?start=${encodeURIComponent(from)}&end=${encodeURIComponent(to)}`);
    if (!rows.length) {
      shown = null;
      out.replaceChildren(h("p", {}, `No requests from ${from} to ${to}.`));
      return;
    }
    shown = { rows, range: buckets(from, to), width: available() };
    out.replaceChildren(
      chart(rows, shown.range, measure.value, shown.width),
      table(`Totals, ${from} to ${to}`, ["Adapter", "Requests", "Prompt tokens", "Completion tokens"], totals(rows)),
    );
  };
  const form = h(
    "form",
    { class: "row", id: "usage-form", on: { submit: app.guard(draw, out) } },
    field("usage-start", "From (UTC)", start),
    field("usage-end", "To (UTC)", end),
    field("usage-measure", "Show", measure),
    h("div", { class: "field" }, h("button", { type: "submit" }, "Show")),
  );
  await draw();
  new ResizeObserver(() => {
    if (!shown || !out.isConnected || Math.abs(available() - shown.width) < 24) return;
    shown.width = available();
    out.firstChild.replaceWith(chart(shown.rows, shown.range, measure.value, shown.width));
  }).observe(out);
  return h("div", {}, h("h1", {}, "Usage"), form, out);
}
