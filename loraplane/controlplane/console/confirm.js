// Asking before an action that cannot be undone or that changes what production serves
// (delete, serve a version, roll back, follow latest, revoke a key): a modal <dialog> that says
// what will happen. Cancel has the focus, so Enter or Escape right away changes nothing.

import { h } from "./dom.js";

let open = null; // the dialog on screen, if any: a second request replaces nothing

/** Ask `question` (the dialog's title) with `consequence` (what will happen) and two
 * buttons, Cancel and `action` (`danger`: drawn as destructive). Resolves true only when the
 * action button is pressed; Cancel, Escape or a second request resolve false. */
export function confirm({ question, consequence, action, danger = false }) {
  if (open) return Promise.resolve(false);
  return new Promise((resolve) => {
    const cancel = h(
      "button",
      { type: "button", class: "secondary", id: "confirm-cancel", autofocus: true },
      "Cancel",
    );
    const ok = h(
      "button",
      { type: "button", class: danger ? "danger" : null, id: "confirm-ok" },
      action,
    );
    const dialog = h(
      "dialog",
      {
        id: "confirm-dialog",
        class: "confirm",
        "aria-labelledby": "confirm-question",
        "aria-describedby": "confirm-consequence",
      },
      h("h2", { id: "confirm-question" }, question),
      h("p", { id: "confirm-consequence" }, consequence),
      h("div", { class: "confirm-buttons" }, cancel, ok),
    );
    cancel.addEventListener("click", () => dialog.close("cancel"));
    ok.addEventListener("click", () => dialog.close("confirm"));
    // Escape fires "cancel" and closes the dialog with an empty returnValue: not confirmed
    dialog.addEventListener("close", () => {
      open = null;
      dialog.remove();
      resolve(dialog.returnValue === "confirm");
    });
    // leaving the view (back, a link) answers no: the question was about that view
    window.addEventListener("hashchange", () => dialog.open && dialog.close("cancel"), {
      once: true,
    });
    document.body.append(dialog);
    open = dialog;
    dialog.showModal();
    cancel.focus();
  });
}
