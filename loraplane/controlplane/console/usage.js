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

function days(start, end) {
  const out = [];
  for (let d = new Date(`${start}T00:00:00Z`); d <= new Date(`${end}T00:00:00Z`); ) {
    out.push(d.toISOString().slice(0, 10));
    d.setUTCDate(d.getUTCDate() + 1);
    if (out.length > 366) break;
  }
  return out;
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
    `${row.adapter || BASE} on ${row.day}: ${count(row.requests)} requests, ` +
    `${count(row.prompt_tokens)} prompt + ${count(row.completion_tokens)} completion tokens`
  );
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

/** The chart: one stacked bar per day, one segment per adapter. */
export function chart(rows, range, measure) {
  const { width, height, left, right, top, bottom } = SIZE;
  const of = MEASURES[measure].of;
  const adapters = [...new Set(rows.map((r) => r.adapter))].sort();
  const color = (a) => COLORS[adapters.indexOf(a) % COLORS.length];
  const byDay = new Map(range.map((d) => [d, []]));
  for (const r of rows) if (byDay.has(r.day)) byDay.get(r.day).push(r);
  const max = niceMax(Math.max(0, ...[...byDay.values()].map((rs) => rs.reduce((n, r) => n + of(r), 0))));
  const plotH = height - top - bottom;
  const slot = (width - left - right) / range.length;
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
  const every = Math.ceil(range.length / 10);
  const bars = range.map((day, i) => {
    let base = 0;
    const x = left + i * slot + (slot - barW) / 2;
    const segments = byDay.get(day).map((r) => {
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
    const label = i % every === 0 ? svg("text", { x: x + barW / 2, y: height - bottom + 16, "text-anchor": "middle" }, day.slice(5)) : null;
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
      viewBox: `0 0 ${width} ${height}`,
      role: "group",
      "aria-label": `${MEASURES[measure].label} per day and adapter, ${range[0]} to ${range[range.length - 1]}`,
    },
    grid,
    bars,
    svg("text", { x: left, y: height - 8, class: "axis" }, "UTC day"),
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
  const draw = async () => {
    const from = start.value || utcDay(-13);
    const to = end.value || utcDay(0);
    const rows = await call("GET", `v1/usage?start=${encodeURIComponent(from)}&end=${encodeURIComponent(to)}`);
    if (!rows.length) {
      out.replaceChildren(h("p", {}, `No requests from ${from} to ${to}.`));
      return;
    }
    out.replaceChildren(
      chart(rows, days(from, to), measure.value),
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
  return h("div", {}, h("h1", {}, "Usage"), form, out);
}
