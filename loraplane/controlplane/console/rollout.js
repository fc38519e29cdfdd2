// A weighted rollout on the adapter page (docs/controlplane.md, "Weighted rollouts"): the
// split the plain name serves, and the actions that start one (a canary at a chosen weight),
// promote one of its versions or roll it back; each asked first.

import { call } from "./api.js";
import { confirm } from "./confirm.js";
import { field, h } from "./dom.js";

const enc = encodeURIComponent;

/** A split in words: "v1 90%, v2 10%". */
export function splitText(rollout) {
  return rollout.map((r) => `v${r.version} ${r.weight}%`).join(", ");
}

/** The "Rollout" fact: the split and what a rollback serves, or that none runs. */
export function rolloutFact(a) {
  if (!a.rollout) return "none: every request to the plain name gets the version it serves";
  return `${splitText(a.rollout)} of requests to ${a.name}; rolling back serves v${a.current_version}`;
}

/** The rollout's controls: Promote vN and Roll back while one runs; otherwise a form that
 * starts a canary (a version besides the current one, at a weight from 1 to 99). */
export function rolloutControls(app, a, versions, place) {
  const base = `v1/adapters/${enc(a.name)}`;
  const act = (ask, run) =>
    app.guard(async () => {
      if (!(await confirm(ask))) return;
      const answer = await run();
      app.notify(
        answer.rollout
          ? `${a.name} now splits its requests: ${splitText(answer.rollout)}.`
          : `${a.name} now serves v${answer.current_version} alone.`,
      );
      await app.refresh();
    }, place);
  const button = (id, text, handler, kind = "secondary") =>
    h("button", { type: "button", id, class: kind, on: { click: handler } }, text);
  if (a.rollout) {
    const promotable = a.rollout.filter((r) => r.version !== a.current_version && r.weight > 0);
    return h(
      "div",
      { class: "row actions", id: "rollout-actions" },
      promotable.map((r) =>
        button(
          `rollout-promote-${r.version}`,
          `Promote v${r.version}`,
          act(
            {
              question: `Promote v${r.version} of ${a.name}?`,
              consequence:
                `Every request to ${a.name} will use v${r.version} (it takes ${r.weight}% now); ` +
                "the rollout ends and v" + r.version + " is held until you choose again.",
              action: `Promote v${r.version}`,
            },
            () => call("POST", `${base}/rollout/promote`, { version: r.version }),
          ),
        ),
      ),
      button(
        "rollout-rollback",
        `Roll back to v${a.current_version}`,
        act(
          {
            question: `Roll back ${a.name}'s rollout?`,
            consequence: `Every request to ${a.name} will use v${a.current_version} again (now: ${splitText(a.rollout)}).`,
            action: `Roll back to v${a.current_version}`,
          },
          () => call("POST", `${base}/rollout/rollback`),
        ),
      ),
    );
  }
  const others = versions.map((v) => v.version).filter((v) => v !== a.current_version);
  if (a.current_version === null || !others.length) return null;
  const canary = h(
    "select",
    {},
    others.map((v) => h("option", { value: String(v) }, `v${v}`)),
  );
  canary.value = String(Math.max(...others));
  const weight = h("input", { type: "number", min: "1", max: "99", step: "1", value: "10" });
  const start = app.guard(async () => {
    const w = Number(weight.value);
    const v = Number(canary.value);
    if (!Number.isInteger(w) || w < 1 || w > 99) {
      weight.setCustomValidity("a whole number from 1 to 99");
      weight.reportValidity();
      return;
    }
    weight.setCustomValidity("");
    const split = { [a.current_version]: 100 - w, [v]: w };
    const yes = await confirm({
      question: `Send ${w}% of ${a.name}'s requests to v${v}?`,
      consequence:
        `v${a.current_version} keeps ${100 - w}% and is what a rollback serves; replicas load ` +
        `v${v} before its first request. New uploads are stored, not served, meanwhile.`,
      action: `Start the rollout`,
    });
    if (!yes) return;
    const answer = await call("PATCH", base, { rollout: split });
    app.notify(`${a.name} now splits its requests: ${splitText(answer.rollout || [])}.`);
    await app.refresh();
  }, place);
  return h(
    "form",
    { class: "row", id: "rollout-form", on: { submit: start } },
    field("rollout-version", "Canary version", canary),
    field("rollout-weight", "Canary weight (%)", weight),
    h("button", { type: "submit", class: "secondary", id: "rollout-start" }, "Start a rollout"),
  );
}
