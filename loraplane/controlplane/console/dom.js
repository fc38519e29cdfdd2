// Building the page from data. Every string becomes a text node or an attribute value set
// with setAttribute: nothing the API returns is ever parsed as markup.

const SVG_NS = "http://www.w3.org/2000/svg";
// Properties set as DOM properties rather than attributes.
const PROPERTIES = new Set(["value", "checked", "disabled", "hidden", "selected", "open"]);

function setProps(el, props) {
  for (const [key, value] of Object.entries(props || {})) {
    if (value === undefined || value === null || value === false) continue;
    if (key === "on") {
      for (const [event, handler] of Object.entries(value)) el.addEventListener(event, handler);
    } else if (key === "dataset") {
      Object.assign(el.dataset, value);
    } else if (key.toLowerCase().startsWith("on")) {
      // event handlers are functions passed in `on`, never attribute text
      throw new Error(`refusing the attribute ${key}`);
    } else if (PROPERTIES.has(key)) {
      el[key] = value;
    } else {
      el.setAttribute(key, value === true ? "" : String(value));
    }
  }
}

/** Append children: Nodes as they are; strings and numbers as text; arrays flattened. */
export function append(el, children) {
  for (const child of children.flat(Infinity)) {
    if (child === undefined || child === null || child === false) continue;
    el.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return el;
}

/** An HTML element: h("a", {href: "#/x", class: "c"}, "text", otherNode). */
export function h(tag, props, ...children) {
  const el = document.createElement(tag);
  setProps(el, props);
  return append(el, children);
}

/** An SVG element, the same way. */
export function svg(tag, props, ...children) {
  const el = document.createElementNS(SVG_NS, tag);
  setProps(el, props);
  return append(el, children);
}

/** A labelled form control: [label, control] with the label's `for` set. */
export function field(id, text, control, hint) {
  control.id = id;
  const parts = [h("label", { for: id }, text), control];
  if (hint) {
    control.setAttribute("aria-describedby", `${id}-hint`);
    parts.push(h("p", { id: `${id}-hint`, class: "hint" }, hint));
  }
  return h("div", { class: "field" }, parts);
}

/** A table in a box that scrolls sideways on its own when the table is wider than the page
 * (a phone), so the page itself never does. */
export function scrolling(tableElement) {
  return h("div", { class: "table-scroll" }, tableElement);
}

/** A table: headers, then rows of cells (each a string, a Node or an array of them), in its
 * own scrolling box. */
export function table(caption, headers, rows) {
  return scrolling(
    h(
      "table",
      {},
      caption ? h("caption", {}, caption) : null,
      h("thead", {}, h("tr", {}, headers.map((x) => h("th", { scope: "col" }, x)))),
      h("tbody", {}, rows.map((cells) => h("tr", {}, cells.map((c) => h("td", {}, c))))),
    ),
  );
}

/** A <pre> block with a button that copies its text. */
export function copyable(text, label) {
  const code = h("code", {}, text);
  const status = h("span", { class: "copied", role: "status" });
  const button = h(
    "button",
    {
      type: "button",
      class: "secondary small",
      "aria-label": `Copy ${label}`,
      on: {
        click: async () => {
          try {
            await navigator.clipboard.writeText(code.textContent);
            status.textContent = "copied";
          } catch {
            const range = document.createRange();
            range.selectNodeContents(code);
            getSelection().removeAllRanges();
            getSelection().addRange(range);
            status.textContent = "selected: press Ctrl+C";
          }
        },
      },
    },
    "Copy",
  );
  return h("div", { class: "copyable" }, h("pre", {}, code), h("div", {}, button, status));
}
