// The tenant's pinned adapter versions (GET /v1/pins; docs/controlplane.md, "Pinned
// adapters"): each pin's pool and k, how many of its replicas hold it, which refused it and
// why (from the replicas' last reports), and Unpin, asked first.

import { call } from "./api.js";
import { confirm } from "./confirm.js";
import { h, table } from "./dom.js";
import { bytes } from "./format.js";

const enc = encodeURIComponent;

/** "1 of 2" (held of k), with "(1 on the device)" when fewer are resident than held. */
export function heldText(pin) {
  const resident = pin.resident < pin.held ? ` (${pin.resident} on the device)` : "";
  return `${pin.held} of ${pin.replicas}${resident}`;
}

/** The refusals in words: "none", or "rep-0: <why>; rep-1: <why>". */
export function refusedText(pin) {
  if (!pin.refused.length) return "none";
  return pin.refused.map((r) => `${r.replica}: ${r.reason}`).join("; ");
}

function unpin(app, pin, place) {
  const where = `${pin.namespace}/${pin.pool}`;
  const id = `unpin-${pin.adapter}-${pin.version}-${pin.pool}`;
  const handler = app.guard(async () => {
    const yes = await confirm({
      question: `Unpin ${pin.adapter} v${pin.version} on ${where}?`,
      consequence:
        `Its ${pin.replicas} replica${pin.replicas === 1 ? "" : "s"} may evict it like any idle ` +
        "adapter again, so its next request after a flood may wait for a load.",
      action: "Unpin",
      danger: true,
    });
    if (!yes) return;
    const query = `pool=${enc(pin.pool)}&namespace=${enc(pin.namespace)}`;
    await call("DELETE", `v1/adapters/${enc(pin.adapter)}/versions/${pin.version}/pin?${query}`);
    app.notify(`${pin.adapter} v${pin.version} is no longer pinned on ${where}.`);
    await app.refresh();
  }, place);
  return h("button", { type: "button", class: "secondary", id, on: { click: handler } }, "Unpin");
}

/** #/pins: the caller's pins. */
export async function view(app) {
  const pins = await call("GET", "v1/pins");
  const place = h("div", { id: "pins-problem" });
  const rows = pins.map((p) => [
    h("a", { href: `#/adapters/${enc(p.adapter)}` }, p.adapter),
    `v${p.version}`,
    `${p.namespace}/${p.pool}`,
    String(p.replicas),
    heldText(p),
    refusedText(p),
    bytes(p.pinned_bytes),
    unpin(app, p, place),
  ]);
  return h(
    "div",
    { id: "pins" },
    h("h1", {}, "Pins"),
    h(
      "p",
      {},
      "A pinned version stays on the device of k replicas of a pool, whatever else runs; " +
        "its bytes count against your max_pinned_bytes quota. Pin with the CLI or the API.",
    ),
    place,
    pins.length
      ? table(
          `${pins.length} pin${pins.length === 1 ? "" : "s"}`,
          ["Adapter", "Version", "Pool", "Replicas (k)", "Held", "Refused", "Pinned bytes", ""],
          rows,
        )
      : h("p", {}, "No pins."),
  );
}
