"""The interactive HTML view of `ladder plot`: one file, no network, a small SVG plotter written here.

Why no plotting library: the page must open anywhere (an air-gapped cluster login node, a published run
page) without a CDN, and a vendored charting bundle would be larger than everything else. Python turns
`PlotData` into panel specs (series of x/y arrays, bands, error bars); the inline script only draws
them. Interaction: drag across a panel to zoom its x range, the mouse wheel zooms around the cursor,
double-click resets; hovering shows the nearest point's values; a link ending in
`#zoom=PANEL:X0:X1` (PANEL one of curves, zoom, residuals, history) opens a panel zoomed. The y range follows the visible data,
so zooming on the late curve magnifies it. The PlotData tables are embedded as JSON too
(`<script id="plot-data">`), so the page is also the data.
"""

from __future__ import annotations

import html
import json
import math
from pathlib import Path
from typing import Any

from ladder.views.common import BAND_COLOR, FIRST_BAND_COLOR, RUNG_COLORS, X_COLUMNS, X_LABELS, PlotData, drawn_band, zoom_range


def _nums(values) -> list[float | None]:
    return [float(v) if v is not None and not (isinstance(v, float) and math.isnan(v)) and math.isfinite(float(v)) else None for v in values]


def _series(name: str, kind: str, color: str, x, y, lo=None, hi=None, dash: str | None = None) -> dict[str, Any]:
    out = {"name": name, "kind": kind, "color": color, "x": _nums(x), "y": _nums(y) if y is not None else None}
    if lo is not None:
        out["lo"], out["hi"] = _nums(lo), _nums(hi)
    if dash:
        out["dash"] = dash
    return out


def panel_specs(data: PlotData, x: str = "compute") -> list[dict[str, Any]]:
    """The four panels as plain specs for the inline renderer."""
    target_name = data.target or "(no target)"
    col = X_COLUMNS[x]
    curve_series: list[dict] = []
    runs = sorted(data.rungs["run"].unique())
    colors = {run: RUNG_COLORS[i % len(RUNG_COLORS)] for i, run in enumerate(runs)}
    for run in runs:
        rows = data.rungs[data.rungs["run"] == run]
        curve_series.append(_series(f"rung {run}", "points", colors[run], rows[col], rows["loss"]))
    for run, rows in data.fits.groupby("run", sort=True):
        curve_series.append(_series(f"fitted law ({run})", "line", colors.get(run, "#666666"), rows[col], rows["loss"]))
    versions = sorted(int(v) for v in data.bands["version"].unique()) if not data.bands.empty else []
    if len(versions) > 1:
        first = drawn_band(data, versions[0])
        curve_series.append(_series(f"{target_name} forecast v{versions[0]} (first)", "band", FIRST_BAND_COLOR,
                                    first[col], first["loss"], first["lo"], first["hi"], dash="5,4"))
    band = drawn_band(data)
    if not band.empty:
        kind = "errorbar" if len(band) == 1 else "band"  # a final-loss law forecasts one point
        curve_series.append(_series(f"{target_name} forecast v{versions[-1]} (newest), 95% band", kind, BAND_COLOR,
                                    band[col], band["loss"], band["lo"], band["hi"]))
    if not data.actual.empty:
        curve_series.append(_series(f"{target_name} actual", "points", "#000000", data.actual[col], data.actual["loss"]))
    window = zoom_range(data, x)
    panels = [
        {"id": "curves", "title": "ladder, fits and target forecast", "xlabel": X_LABELS[x], "ylabel": data.loss_label,
         "xlog": True, "series": curve_series, "legend": "bl"},
        {"id": "zoom", "title": f"{target_name}: late curve (drag/wheel: zoom x; double-click: reset)",
         "xlabel": X_LABELS[x], "ylabel": data.loss_label, "xlog": True, "series": curve_series,
         "xrange": list(window) if window else None, "legend": "bl"},
    ]
    hist = data.history
    panels.append({
        "id": "history", "title": "refit history: predicted final loss per forecast version (95% interval)",
        "xlabel": "forecast version", "ylabel": f"predicted final {data.loss_label}", "xlog": False,
        "series": [_series("final loss", "errorbar", BAND_COLOR, hist["version"], hist["final_loss"],
                           hist["final_loss_lo"], hist["final_loss_hi"])] if not hist.empty else [],
        "labels": [f"v{int(v)} {m}" for v, m in zip(hist["version"], hist["method"], strict=True)],
    })
    res_series = []
    res = data.residuals
    if not res.empty:
        newest = int(res["version"].max())
        rows = res[res["version"] == newest].sort_values("step")
        res_series.append(_series(f"v{newest} 95% band", "area", BAND_COLOR, rows[col], None,
                                  100 * (rows["lo"] / rows["predicted"] - 1), 100 * (rows["hi"] / rows["predicted"] - 1)))
        for i, (version, rows) in enumerate(res.groupby("version", sort=True)):
            rows = rows.sort_values("step")
            color = BAND_COLOR if version == newest else RUNG_COLORS[i % len(RUNG_COLORS)]
            res_series.append(_series(f"vs forecast v{version}", "linepoints", color, rows[col], 100 * rows["residual"]))
    panels.append({"id": "residuals", "title": f"{target_name}: residuals, actual / predicted - 1",
                   "xlabel": X_LABELS[x], "ylabel": "residual (%)", "xlog": True, "series": res_series, "zero": True})
    return panels


def build_html(data: PlotData, x: str = "compute") -> str:
    payload = {"panels": panel_specs(data, x), "data": data.to_dict(), "x": x}
    text = json.dumps(payload, allow_nan=False, separators=(",", ":")).replace("</", "<\\/")
    title = html.escape(data.title)
    method = html.escape(data.method or "no stored forecast")
    warnings = "".join(f"<li>{html.escape(w)}</li>" for w in data.warnings)
    return (
        _TEMPLATE.replace("{{TITLE}}", title).replace("{{METHOD}}", method)
        .replace("{{WARNINGS}}", f"<ul class='warn'>{warnings}</ul>" if warnings else "")
        .replace("{{DATA}}", text).replace("{{SCRIPT}}", _SCRIPT)
    )


def render_html(data: PlotData, out: str | Path, x: str = "compute") -> Path:
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(build_html(data, x), encoding="utf-8")
    return out


def embedded_data(page: str) -> dict[str, Any]:
    """The JSON payload of a page written by render_html (for tests and scripts)."""
    start = page.index('<script type="application/json" id="plot-data">') + len('<script type="application/json" id="plot-data">')
    end = page.index("</script>", start)
    return json.loads(page[start:end].replace("<\\/", "</"))


_TEMPLATE = """<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>{{TITLE}}</title>
<style>
body{font-family:system-ui,Arial,sans-serif;margin:12px;color:#222;background:#fff}
h1{font-size:17px;margin:0 0 2px 0} .method{font-size:13px;color:#555;margin-bottom:6px}
.grid{display:grid;grid-template-columns:repeat(auto-fit,minmax(540px,1fr));gap:10px}
.panel{border:1px solid #ddd;border-radius:4px;padding:4px;position:relative}
.panel svg{width:100%;height:auto;display:block;user-select:none}
.tip{position:absolute;pointer-events:none;background:rgba(255,255,255,.95);border:1px solid #999;border-radius:3px;
font-size:11px;padding:3px 5px;display:none;white-space:pre;z-index:2}
.warn{font-size:12px;color:#8a5a00;margin:4px 0}
text{font-size:11px} .ptitle{font-size:13px;font-weight:600} .legend{font-size:10px}
</style></head><body>
<h1>{{TITLE}}</h1><div class="method">method: {{METHOD}}</div>{{WARNINGS}}
<div class="grid" id="panels"></div>
<script type="application/json" id="plot-data">{{DATA}}</script>
<script>{{SCRIPT}}</script>
</body></html>
"""

_SCRIPT = r"""
(function(){
"use strict";
var NS="http://www.w3.org/2000/svg";
var W=560,H=380,M={l:62,r:12,t:26,b:44};
var payload=JSON.parse(document.getElementById("plot-data").textContent);
function el(name,attrs,parent){var e=document.createElementNS(NS,name);for(var k in attrs){e.setAttribute(k,attrs[k]);}if(parent){parent.appendChild(e);}return e;}
function fmt(v){if(v===null||v===undefined){return "-";}var a=Math.abs(v);if(a!==0&&(a>=1e5||a<1e-3)){return v.toExponential(3);}return (Math.round(v*10000)/10000).toString();}
function finite(v){return v!==null&&v!==undefined&&isFinite(v);}
function niceTicks(lo,hi,n){var span=hi-lo;if(!(span>0)){return [lo];}var step=Math.pow(10,Math.floor(Math.log10(span/n)));var err=span/n/step;
 if(err>=7.5){step*=10;}else if(err>=3.5){step*=5;}else if(err>=1.5){step*=2;}var out=[];for(var v=Math.ceil(lo/step)*step;v<=hi+step*1e-9;v+=step){out.push(Math.abs(v)<step*1e-9?0:v);}return out;}
function logTicks(lo,hi){var a=Math.floor(Math.log10(lo)),b=Math.ceil(Math.log10(hi)),out=[];var every=Math.max(1,Math.ceil((b-a)/8));
 for(var p=a;p<=b;p+=every){var v=Math.pow(10,p);if(v>=lo*0.999&&v<=hi*1.001){out.push(v);}}
 if(out.length<2){var t=niceTicks(lo,hi,3);out=t.filter(function(v){return v>0;});}return out;}
function xValues(s){var out=[];s.x.forEach(function(v){if(finite(v)){out.push(v);}});return out;}
function chart(spec,container){
 var div=document.createElement("div");div.className="panel";div.id="panel-"+spec.id;container.appendChild(div);
 var svg=el("svg",{viewBox:"0 0 "+W+" "+H,"data-panel":spec.id},div);
 var tip=document.createElement("div");tip.className="tip";div.appendChild(tip);
 var all=[];spec.series.forEach(function(s){all=all.concat(xValues(s));});
 if(spec.xlog){all=all.filter(function(v){return v>0;});}
 var full=all.length?[Math.min.apply(null,all),Math.max.apply(null,all)]:[0,1];
 if(full[0]===full[1]){full=spec.xlog?[full[0]/2,full[0]*2]:[full[0]-0.5,full[1]+0.5];}
 if(!spec.xlog&&spec.id==="history"){full=[full[0]-0.5,full[1]+0.5];}
 else if(spec.xlog){var lspan=Math.log10(full[1]/full[0])*0.03;full=[full[0]/Math.pow(10,lspan),full[1]*Math.pow(10,lspan)];}
 else{var span=(full[1]-full[0])*0.03;full=[full[0]-span,full[1]+span];}
 var view=spec.xrange?spec.xrange.slice():full.slice();
 var fx=function(v){return spec.xlog?Math.log10(v):v;},ifx=function(u){return spec.xlog?Math.pow(10,u):u;};
 var pw=W-M.l-M.r,ph=H-M.t-M.b,drag=null,pts=[];
 function yRange(){var ys=[];spec.series.forEach(function(s){for(var i=0;i<s.x.length;i++){var x=s.x[i];if(!finite(x)||x<view[0]||x>view[1]){continue;}
  [s.y?s.y[i]:null,s.lo?s.lo[i]:null,s.hi?s.hi[i]:null].forEach(function(v){if(finite(v)){ys.push(v);}});}});
  if(spec.zero){ys.push(0);}if(!ys.length){return [0,1];}var lo=Math.min.apply(null,ys),hi=Math.max.apply(null,ys),pad=Math.max((hi-lo)*0.06,Math.max(Math.abs(lo),Math.abs(hi))*1e-3,1e-9);return [lo-pad,hi+pad];}
 function draw(){
  while(svg.firstChild){svg.removeChild(svg.firstChild);}pts=[];
  var yr=yRange(),x0=fx(view[0]),x1=fx(view[1]);
  var sx=function(v){return M.l+(fx(v)-x0)/(x1-x0)*pw;},sy=function(v){return M.t+(1-(v-yr[0])/(yr[1]-yr[0]))*ph;};
  var clipId="clip-"+spec.id,defs=el("defs",{},svg),cp=el("clipPath",{id:clipId},defs);el("rect",{x:M.l,y:M.t,width:pw,height:ph},cp);
  el("rect",{x:M.l,y:M.t,width:pw,height:ph,fill:"#fff",stroke:"#999"},svg);
  var xt=spec.xlog?logTicks(view[0],view[1]):niceTicks(view[0],view[1],6);
  if(spec.id==="history"){xt=xt.filter(function(v){return Math.abs(v-Math.round(v))<1e-9;});}
  xt.forEach(function(v){var X=sx(v);el("line",{x1:X,x2:X,y1:M.t,y2:M.t+ph,stroke:"#eee"},svg);
   var t=el("text",{x:X,y:M.t+ph+14,"text-anchor":"middle"},svg);var lg=Math.log10(v);t.textContent=spec.xlog?(Math.abs(lg-Math.round(lg))<1e-6?"1e"+Math.round(lg):v.toExponential(1)):fmt(v);});
  var yt=niceTicks(yr[0],yr[1],6),ystep=yt.length>1?yt[1]-yt[0]:1,ydec=Math.max(0,Math.min(8,-Math.floor(Math.log10(ystep))));
  yt.forEach(function(v){var Y=sy(v);el("line",{x1:M.l,x2:M.l+pw,y1:Y,y2:Y,stroke:"#eee"},svg);
   var t=el("text",{x:M.l-4,y:Y+4,"text-anchor":"end"},svg);t.textContent=(Math.abs(v)>=1e5||ydec>4)?(v===0?"0":v.toExponential(1)):v.toFixed(ydec);});
  var g=el("g",{"clip-path":"url(#"+clipId+")"},svg);
  if(spec.zero){el("line",{x1:M.l,x2:M.l+pw,y1:sy(0),y2:sy(0),stroke:"#000","stroke-width":0.8},g);}
  spec.series.forEach(function(s){
   var idx=[];for(var i=0;i<s.x.length;i++){if(finite(s.x[i])&&(!spec.xlog||s.x[i]>0)){idx.push(i);}}
   function path(arr){var d="";idx.forEach(function(i){if(finite(arr[i])){d+=(d?"L":"M")+sx(s.x[i]).toFixed(1)+","+sy(arr[i]).toFixed(1);}});return d;}
   if((s.kind==="band"||s.kind==="area")&&s.lo){var up="",dn="";idx.forEach(function(i){if(finite(s.lo[i])&&finite(s.hi[i])){up+=(up?"L":"M")+sx(s.x[i]).toFixed(1)+","+sy(s.hi[i]).toFixed(1);}});
    idx.slice().reverse().forEach(function(i){if(finite(s.lo[i])&&finite(s.hi[i])){dn+="L"+sx(s.x[i]).toFixed(1)+","+sy(s.lo[i]).toFixed(1);}});
    if(up){el("path",{d:up+dn+"Z",fill:s.color,"fill-opacity":s.dash?0.06:0.18,stroke:s.dash?s.color:"none","stroke-dasharray":"2,3"},g);}}
   if(s.kind==="line"||s.kind==="band"||s.kind==="linepoints"){var d=path(s.y);if(d){el("path",{d:d,fill:"none",stroke:s.color,"stroke-width":s.kind==="band"?1.8:1.1,"stroke-dasharray":s.dash||"none"},g);}}
   if(s.kind==="points"||s.kind==="linepoints"||s.kind==="errorbar"){idx.forEach(function(i){if(!finite(s.y[i])){return;}var X=sx(s.x[i]),Y=sy(s.y[i]);
     if(s.kind==="errorbar"&&finite(s.lo[i])&&finite(s.hi[i])){el("line",{x1:X,x2:X,y1:sy(s.lo[i]),y2:sy(s.hi[i]),stroke:s.color,"stroke-width":1.5},g);
      [s.lo[i],s.hi[i]].forEach(function(v){el("line",{x1:X-6,x2:X+6,y1:sy(v),y2:sy(v),stroke:s.color,"stroke-width":1.5},g);});}
     el("circle",{cx:X,cy:Y,r:s.kind==="errorbar"?5:(s.name.indexOf("actual")>=0?4:2.6),fill:s.color},g);});}
   idx.forEach(function(i){var v=s.y?s.y[i]:null;if(!finite(v)||s.x[i]<view[0]||s.x[i]>view[1]){return;}pts.push({X:sx(s.x[i]),Y:sy(v),s:s,i:i});});
  });
  if(spec.labels){spec.series.forEach(function(s){s.x.forEach(function(v,i){if(finite(v)&&finite(s.y[i])){var t=el("text",{x:sx(v)+9,y:sy(s.y[i])+4},svg);t.textContent=spec.labels[i]+" "+fmt(s.y[i]);}});});}
  var tt=el("text",{x:M.l,y:16,"class":"ptitle"},svg);tt.textContent=spec.title;
  var xl=el("text",{x:M.l+pw/2,y:H-8,"text-anchor":"middle"},svg);xl.textContent=spec.xlabel+(spec.xlog?" (log scale)":"");
  var yl=el("text",{x:14,y:M.t+ph/2,"text-anchor":"middle",transform:"rotate(-90 14 "+(M.t+ph/2)+")"},svg);yl.textContent=spec.ylabel;
  var firstLine=spec.series.filter(function(o){return o.kind==="line";})[0];
  var shown=spec.series.filter(function(s){return s.kind!=="line"||s===firstLine;});
  var lw=240,lh=12*shown.length+4,corners=[[M.l+pw-lw,M.t+4],[M.l+8,M.t+ph-lh],[M.l+8,M.t+4],[M.l+pw-lw,M.t+ph-lh]];
  var crowd=corners.map(function(c){return pts.filter(function(q){return q.X>=c[0]-6&&q.X<=c[0]+lw&&q.Y>=c[1]-6&&q.Y<=c[1]+lh+6;}).length;});
  var pick=crowd.indexOf(Math.min.apply(null,crowd)),lx=corners[pick][0],ly=corners[pick][1]+8;
  shown.forEach(function(s){
   el("rect",{x:lx,y:ly-8,width:10,height:8,fill:s.color,"fill-opacity":s.kind==="area"?0.3:1},svg);
   var t=el("text",{x:lx+14,y:ly,"class":"legend"},svg);t.textContent=s.kind==="line"?"fitted law (each rung)":s.name;ly+=12;});
  if(!spec.series.length){var e=el("text",{x:M.l+pw/2,y:M.t+ph/2,"text-anchor":"middle"},svg);e.textContent="nothing to show yet";}
  if(drag&&drag.b!==null){var a=Math.min(drag.a,drag.b),b=Math.max(drag.a,drag.b);el("rect",{x:a,y:M.t,width:b-a,height:ph,fill:"#6a3d9a","fill-opacity":0.12},svg);}
  svg.setAttribute("data-drawn",String(pts.length));
 }
 function toData(px){var x0=fx(view[0]),x1=fx(view[1]);return ifx(x0+(px-M.l)/pw*(x1-x0));}
 function localX(ev){var r=svg.getBoundingClientRect();return {X:(ev.clientX-r.left)*W/r.width,Y:(ev.clientY-r.top)*H/r.height,r:r};}
 svg.addEventListener("mousedown",function(ev){var p=localX(ev);if(p.X<M.l||p.X>M.l+pw){return;}drag={a:p.X,b:null};ev.preventDefault();});
 svg.addEventListener("mousemove",function(ev){var p=localX(ev);
  if(drag){drag.b=Math.max(M.l,Math.min(M.l+pw,p.X));draw();return;}
  var best=null,bd=400;pts.forEach(function(q){var d=(q.X-p.X)*(q.X-p.X)+(q.Y-p.Y)*(q.Y-p.Y);if(d<bd){bd=d;best=q;}});
  if(!best){tip.style.display="none";return;}var s=best.s,i=best.i;
  var lines=[s.name,"x: "+fmt(s.x[i]),"y: "+fmt(s.y[i])];if(s.lo&&finite(s.lo[i])){lines.push("band: "+fmt(s.lo[i])+" .. "+fmt(s.hi[i]));}
  tip.textContent=lines.join("\n");tip.style.display="block";tip.style.left=(best.X*p.r.width/W+12)+"px";tip.style.top=(best.Y*p.r.height/H+4)+"px";});
 svg.addEventListener("mouseleave",function(){tip.style.display="none";});
 window.addEventListener("mouseup",function(){if(!drag){return;}var d=drag;drag=null;
  if(d.b!==null&&Math.abs(d.b-d.a)>4){var a=toData(Math.min(d.a,d.b)),b=toData(Math.max(d.a,d.b));if(b>a){view=[a,b];}}draw();});
 svg.addEventListener("wheel",function(ev){var p=localX(ev);if(p.X<M.l||p.X>M.l+pw){return;}ev.preventDefault();
  var c=fx(toData(p.X)),k=ev.deltaY<0?0.8:1.25,x0=fx(view[0]),x1=fx(view[1]);view=[ifx(c-(c-x0)*k),ifx(c+(x1-c)*k)];draw();},{passive:false});
 svg.addEventListener("dblclick",function(){view=full.slice();draw();});
 var asked=(location.hash.match(new RegExp("zoom="+spec.id+":([^:&]+):([^:&]+)"))||[]);
 if(asked.length===3&&parseFloat(asked[2])>parseFloat(asked[1])){view=[parseFloat(asked[1]),parseFloat(asked[2])];}
 draw();
}
var root=document.getElementById("panels");
payload.panels.forEach(function(spec){try{chart(spec,root);}catch(err){var p=document.createElement("pre");p.className="error";p.textContent="panel "+spec.id+": "+err;root.appendChild(p);if(window.console){console.error(err);}}});
document.body.setAttribute("data-rendered",String(payload.panels.length));
})();
"""


def chart_fragment(data: PlotData, x: str = "compute") -> tuple[str, str]:
    """(css, body) of build_html's page, for embedding its charts in a larger page (`ladder report`).

    The body is the panel grid, the embedded data and the script, exactly as build_html writes them; its
    script reads fixed element ids, so a page holds one such fragment."""
    page = build_html(data, x)
    css = page[page.index("<style>") + len("<style>"): page.index("</style>")]
    body = page[page.index('<div class="grid" id="panels">'): page.rindex("</body>")]
    return css, body
