# train a miniature character-level Shakespeare model, like nanoGPT's train_shakespeare_char
# (its split and vocabulary too, so the val loss compares: ~1.47 after 5000 iters there).
# Prepare the data once first:
#   python data.py --input=../shared/data/tinyshakespeare.txt --out_dir=data/shakespeare_char --tokenizer=char
# or, without the file, from its URL:
#   python data.py --input=https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt --out_dir=data/shakespeare_char --tokenizer=char
# then: python train.py config/shakespeare_char.py

out_dir = 'out-shakespeare-char'
data_dir = 'data/shakespeare_char'
eval_interval = 250  # keep frequent because we'll overfit
eval_iters = 200
log_interval = 10  # don't print too too often
# we expect to overfit on this small dataset, so only save when val improves
always_save_checkpoint = False

gradient_accumulation_steps = 1
batch_size = 64
block_size = 256  # context of up to 256 previous characters

# baby GPT model :)
n_layer = 6
n_head = 6
n_embd = 384
dropout = 0.2

learning_rate = 1e-3  # with baby networks can afford to go a bit higher
max_iters = 5000
lr_decay_iters = 5000  # make equal to max_iters usually
min_lr = 1e-4  # learning_rate / 10 usually
beta2 = 0.99  # make a bit bigger because number of tokens per iter is small
warmup_iters = 100  # not super necessary potentially
