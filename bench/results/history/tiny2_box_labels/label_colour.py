"""For each model: attribute scenes, the answer's box on a shape (IoU >= 0.5): does its label name
that shape's colour (kind), split by whether the phrase names a colour (copyable) or not."""
import re, sys, json
from collections import defaultdict
from groundtune.infer import load, predict
from groundtune.data.synth import make_sample, make_scene
from groundtune.boxes import iou
out = {}
rows=[(make_sample(91,i,task="attribute",split="val"), make_scene(91,i,task="attribute",split="val")) for i in range(400)]
for model in sys.argv[1:]:
    gm=load(model)
    ans=predict(gm,[x[0][0] for x in rows],[x[0][1]["phrase"] for x in rows],batch_size=100,max_new_tokens=48)
    st=defaultdict(lambda:[0,0,0])
    for a,((im,r),sc) in zip(ans,rows):
        m=re.search(r'"label": "(\w+) (\w+)"', a.raw or "")
        if not m or a.bbox is None: continue
        best=max(sc.shapes,key=lambda s: iou(a.bbox,list(s.box)))
        if iou(a.bbox,list(best.box))<0.5: continue
        k="phrase names a colour" if sc.query.colour else "phrase names no colour"
        st[k][0]+=1; st[k][1]+= m.group(1)==best.colour; st[k][2]+= m.group(2)==best.kind
    out[model]={k:{"boxes_on_a_shape":n,"label_colour_right":round(c/n,3),"label_kind_right":round(kk/n,3)} for k,(n,c,kk) in st.items()}
    print(model, out[model])
json.dump(out, open("/tmp/label_colour.json","w"), indent=1)
